"""The multi-tensor ops against float64 references and torch's own ops, on every backend:

- ``cpu``: the production CPU kernels (torch.ops.peak.* on CPU tensors);
- ``grid``: the CUDA launcher's plan, metadata and per-block code run on the CPU (an emulated
  grid), with small launch limits so that lists span several launches and tensors are cut
  mid-way; and with the real CUDA limits;
- ``cuda``: the real CUDA kernels (skipped without a GPU).
"""
import itertools
import math

import pytest
import torch

import peak
from peak import ops

from peak_testing import DEVICES, DTYPES, TOLERANCES, assert_close_to_reference, dtype_id

_C = peak._C


class Backend:
    def __init__(self, name, device="cpu", max_tensors=None, max_blocks=None, threads=None):
        self.name, self.device = name, device
        self.max_tensors, self.max_blocks, self.threads = max_tensors, max_blocks, threads

    def __repr__(self):
        return self.name

    def _grid(self, depth):
        mt = self.max_tensors or _C.max_tensors_per_launch(depth)
        return (min(mt, _C.max_tensors_per_launch(depth)), self.max_blocks or _C.max_blocks_per_launch,
                self.threads or _C.threads_per_block)

    def scale_(self, inputs, outputs, scale, found_inf, chunk_size, per_tensor=None):
        if self.name.startswith("grid"):
            s = torch.tensor([scale], dtype=torch.float32)
            _C.emulated.multi_tensor_scale_(inputs, outputs, s, found_inf, chunk_size, *self._grid(2),
                                            per_tensor_found_inf=per_tensor)
        else:
            ops.multi_tensor_scale_(inputs, outputs, scale, found_inf, chunk_size=chunk_size,
                                    per_tensor_found_inf=per_tensor)

    def axpby_(self, xs, ys, outputs, a, b, found_inf, check, chunk_size):
        if self.name.startswith("grid"):
            code = {"none": 0, "x": 1, "y": 2, "both": 3}[check]
            _C.emulated.multi_tensor_axpby_(xs, ys, outputs, torch.tensor([a]), torch.tensor([b]),
                                            found_inf, code, chunk_size, *self._grid(3))
        else:
            ops.multi_tensor_axpby_(xs, ys, outputs, a, b, found_inf, check=check,
                                    chunk_size=chunk_size)

    def l2norm(self, tensors, per_tensor, chunk_size):
        if self.name.startswith("grid"):
            return _C.emulated.multi_tensor_l2norm(tensors, per_tensor, chunk_size, *self._grid(1))
        return ops.multi_tensor_l2norm(tensors, per_tensor=per_tensor, chunk_size=chunk_size)


BACKENDS = [
    Backend("cpu"),
    # 3 tensors and 4 blocks per launch, 5 threads per block: many launches, carried tensors,
    # a thread count that does not divide the chunk.
    Backend("grid_small", max_tensors=3, max_blocks=4, threads=5),
    Backend("grid_real"),
    pytest.param(Backend("cuda", device="cuda"), marks=pytest.mark.cuda),
]

CHUNK = 64  # small chunks so that the boundary cases stay cheap


def make_tensors(sizes, dtype, device, seed=0, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)
            for n in sizes]


SIZE_CASES = {
    "boundaries": [CHUNK - 1, CHUNK, CHUNK + 1, 1, 3 * CHUNK + 7],
    "single": [5 * CHUNK + 3],
    "with_empties": [0, 17, 0, 2 * CHUNK, 0],
    "trailing_empty": [CHUNK + 1, 9, 0],
    "many": [((i * 37) % 150) + 1 for i in range(300)],  # > 136 tensors: more than one launch
}


@pytest.mark.parametrize("backend", BACKENDS, ids=repr)
@pytest.mark.parametrize("case", list(SIZE_CASES))
@pytest.mark.parametrize("in_dtype,out_dtype", list(itertools.product(DTYPES, DTYPES)),
                         ids=lambda d: dtype_id(d))
def test_scale_out_of_place(backend, case, in_dtype, out_dtype):
    sizes = SIZE_CASES[case]
    xs = make_tensors(sizes, in_dtype, backend.device)
    outs = [torch.full_like(x, 7.0, dtype=out_dtype) for x in xs]
    before = [x.clone() for x in xs]
    flag = ops.new_found_inf(backend.device)
    backend.scale_(xs, outs, 0.375, flag, CHUNK)
    for x, x0, out in zip(xs, before, outs):
        assert torch.equal(x, x0), "inputs must not change out of place"
        # torch's own fp32 multiply then one rounding: must be bit-identical.
        expected = (x.float() * torch.tensor(0.375)).to(out_dtype)
        assert torch.equal(out, expected)
        assert_close_to_reference(out, x.double() * 0.375, out_dtype)
    assert flag.item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS, ids=repr)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_scale_in_place(backend, dtype):
    xs = make_tensors(SIZE_CASES["boundaries"], dtype, backend.device)
    expected = [(x.float() * 2.0 ** -10).to(dtype) for x in xs]
    flag = ops.new_found_inf(backend.device)
    backend.scale_(xs, xs, 2.0 ** -10, flag, CHUNK)
    for x, e in zip(xs, expected):
        assert torch.equal(x, e)
    assert flag.item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS, ids=repr)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", [(0, 0), (4, 3 * CHUNK + 6), (2, CHUNK), (3, 0)],
                         ids=lambda w: f"t{w[0]}i{w[1]}")
def test_scale_flags_non_finite_at_chosen_index(backend, dtype, bad, where):
    xs = make_tensors(SIZE_CASES["boundaries"], dtype, backend.device)
    t, i = where
    xs[t][i] = bad
    outs = [torch.empty_like(x, dtype=torch.float32) for x in xs]
    flag = ops.new_found_inf(backend.device)
    backend.scale_(xs, outs, 0.5, flag, CHUNK)
    assert flag.item() == 1.0
    # The non-finite value propagates; everything else is still scaled.
    assert not math.isfinite(outs[t][i].item())
    mask = torch.ones_like(outs[t], dtype=torch.bool)
    mask[i] = False
    assert torch.equal(outs[t][mask], xs[t].float()[mask] * 0.5)


@pytest.mark.parametrize("backend", BACKENDS, ids=repr)
@pytest.mark.parametrize("poisoned", [(), (0,), (4,), (1, 4), (129,), (0, 64, 129)],
                         ids=lambda p: "t" + "_".join(map(str, p)) if p else "clean")
def test_per_tensor_flags_name_the_overflowing_tensors(backend, poisoned):
    sizes = SIZE_CASES["many"]  # 300 tensors: several launches on the grid backends
    xs = make_tensors(sizes, torch.bfloat16, backend.device, seed=7)
    for t in poisoned:
        xs[t][sizes[t] - 1] = math.inf  # the last element: the tensor's last chunk
    flags = torch.zeros(len(xs), device=backend.device)
    flag = ops.new_found_inf(backend.device)
    backend.scale_(xs, xs, 0.5, flag, CHUNK, per_tensor=flags)
    assert flags.nonzero().flatten().tolist() == list(poisoned)
    assert flag.item() == (1.0 if poisoned else 0.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_check_finite_flags_exactly_the_non_finite_bit_patterns(dtype):
    """NOTE: [Finiteness from the bits]: the CPU check of a 16-bit list reads exponent bits; every
    one of the 65,536 patterns is flagged exactly when torch's isfinite of its value is False."""
    patterns = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = torch.isfinite(patterns.float())
    found = ops.new_found_inf()
    ops.multi_tensor_check_finite_([patterns[finite]], found)
    assert found.item() == 0.0
    # Each non-finite pattern alone in a finite tensor, at every position of a 37-element tensor
    # in turn (vector lanes and the scalar tail).
    bad = patterns[~finite]
    xs = [torch.ones(37, dtype=dtype) for _ in bad]
    for k, (x, b) in enumerate(zip(xs, bad)):
        x[k % 37] = b
    xs.insert(len(xs) // 2, patterns[finite])  # one finite tensor among them: not flagged
    per = torch.zeros(len(xs))
    ops.multi_tensor_check_finite_(xs, found, per_tensor_found_inf=per)
    assert found.item() == 1.0 and per.sum().item() == len(xs) - 1 and per[len(xs) // 2] == 0
    assert len(bad) == (2048 if dtype == torch.float16 else 256)  # sign x mantissa, exponent 1s


def test_per_tensor_flags_must_match_the_list():
    with pytest.raises(RuntimeError, match=r"per_tensor_found_inf must be a contiguous float32 tensor with one element per input \(2\)"):
        ops.multi_tensor_scale_([torch.ones(3)] * 2, [torch.ones(3)] * 2, 1.0, ops.new_found_inf(),
                                per_tensor_found_inf=torch.zeros(3))


@pytest.mark.parametrize("backend", BACKENDS, ids=repr)
def test_axpby_coefficients_as_device_tensors(backend):
    xs = make_tensors([100, 7], torch.float16, backend.device, seed=3)
    ys = make_tensors([100, 7], torch.float32, backend.device, seed=4)
    outs = [torch.empty_like(y) for y in ys]
    a, b = torch.tensor([0.125], device=backend.device), torch.tensor([2.0], device=backend.device)
    if backend.name.startswith("grid"):
        _C.emulated.multi_tensor_axpby_(xs, ys, outs, a, b, ops.new_found_inf(), 3, CHUNK,
                                        *backend._grid(3))
    else:
        ops.multi_tensor_axpby_(xs, ys, outs, a, b, ops.new_found_inf(backend.device), chunk_size=CHUNK)
    for x, y, o in zip(xs, ys, outs):
        assert torch.equal(o, x.float() * 0.125 + y * 2.0)


@pytest.mark.parametrize("backend", BACKENDS, ids=repr)
def test_flag_is_never_cleared(backend):
    xs = make_tensors([10, 100], torch.float32, backend.device)
    flag = torch.ones(1, device=backend.device)
    backend.scale_(xs, xs, 1.0, flag, CHUNK)
    assert flag.item() == 1.0


# The dispatcher ops only: the emulated-grid entry point always takes a tensor scale.
@pytest.mark.parametrize("device", DEVICES)
def test_scale_by_device_tensor(device):
    backend = Backend(device, device=device)
    xs = make_tensors([100, 3], torch.float16, backend.device)
    outs = [torch.empty_like(x, dtype=torch.float32) for x in xs]
    inv = torch.tensor([0.25], device=backend.device)
    ops.multi_tensor_scale_(xs, outs, inv, ops.new_found_inf(backend.device), chunk_size=CHUNK)
    for x, o in zip(xs, outs):
        assert torch.equal(o, x.float() * 0.25)


@pytest.mark.parametrize("backend", BACKENDS, ids=repr)
@pytest.mark.parametrize("case", ["boundaries", "with_empties", "many"])
@pytest.mark.parametrize("x_dtype,y_dtype,out_dtype",
                         list(itertools.product(DTYPES, DTYPES, DTYPES)),
                         ids=lambda d: dtype_id(d))
def test_axpby(backend, case, x_dtype, y_dtype, out_dtype):
    sizes = SIZE_CASES[case]
    xs = make_tensors(sizes, x_dtype, backend.device, seed=1)
    ys = make_tensors(sizes, y_dtype, backend.device, seed=2)
    outs = [torch.empty_like(x, dtype=out_dtype) for x in xs]
    a, b = 0.7, -1.3
    flag = ops.new_found_inf(backend.device)
    backend.axpby_(xs, ys, outs, a, b, flag, "both", CHUNK)
    a32, b32 = float(torch.tensor(a).float()), float(torch.tensor(b).float())
    for x, y, out in zip(xs, ys, outs):
        ax, by = a32 * x.double(), b32 * y.double()
        reference = ax + by
        # Rounding of the result to out_dtype, plus fp32 rounding of the products, which
        # cancellation can make large relative to the result.
        bound = (TOLERANCES[out_dtype]["rtol"] * reference.abs()
                 + 2.0 ** -23 * (ax.abs() + by.abs()))
        assert ((out.double() - reference).abs() <= bound).all(), (out, reference)
    assert flag.item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS, ids=repr)
@pytest.mark.parametrize("check,poison,expect", [
    ("both", "x", 1.0), ("both", "y", 1.0), ("x", "x", 1.0), ("x", "y", 0.0),
    ("y", "y", 1.0), ("y", "x", 0.0), ("none", "x", 0.0), ("none", "y", 0.0)])
def test_axpby_check_selects_inputs(backend, check, poison, expect):
    sizes = SIZE_CASES["boundaries"]
    xs = make_tensors(sizes, torch.float16, backend.device, seed=1)
    ys = make_tensors(sizes, torch.float32, backend.device, seed=2)
    (xs if poison == "x" else ys)[4][3 * CHUNK + 1] = math.nan
    outs = [torch.empty_like(y) for y in ys]
    flag = ops.new_found_inf(backend.device)
    backend.axpby_(xs, ys, outs, 1.0, 1.0, flag, check, CHUNK)
    assert flag.item() == expect


@pytest.mark.parametrize("backend", BACKENDS, ids=repr)
def test_axpby_accumulates_into_y_in_place(backend):
    # Apex's gradient accumulation: stash += grad / S, written over the stash.
    grads = make_tensors(SIZE_CASES["boundaries"], torch.float16, backend.device, seed=3)
    stash = make_tensors(SIZE_CASES["boundaries"], torch.float32, backend.device, seed=4)
    expected = [g.float() / 1024 + s for g, s in zip(grads, stash)]
    backend.axpby_(grads, stash, stash, 1 / 1024, 1.0, ops.new_found_inf(backend.device), "x", CHUNK)
    for s, e in zip(stash, expected):
        assert torch.equal(s, e)


@pytest.mark.parametrize("backend", BACKENDS, ids=repr)
@pytest.mark.parametrize("case", list(SIZE_CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_l2norm(backend, case, dtype):
    sizes = SIZE_CASES[case]
    xs = make_tensors(sizes, dtype, backend.device, seed=5)
    total, per = backend.l2norm(xs, True, CHUNK)
    assert total.dtype == torch.float32 and total.shape == (1,)
    assert per.shape == (len(xs),)
    reference = [torch.linalg.vector_norm(x.double()).cpu() if x.numel()
                 else torch.zeros((), dtype=torch.float64) for x in xs]
    expected_total = torch.sqrt(sum(r * r for r in reference))
    # fp32 accumulation over up to ~10^3 terms.
    torch.testing.assert_close(total.double().cpu()[0], expected_total, rtol=1e-5, atol=0)
    torch.testing.assert_close(per.double().cpu(), torch.stack(reference), rtol=1e-5, atol=0)
    total_only, empty = backend.l2norm(xs, False, CHUNK)
    assert empty.numel() == 0
    assert torch.equal(total_only, total)


@pytest.mark.parametrize("backend", BACKENDS, ids=repr)
def test_l2norm_non_finite_propagates(backend):
    xs = make_tensors([10, 200], torch.float32, backend.device)
    xs[1][150] = math.inf
    total, per = backend.l2norm(xs, True, CHUNK)
    assert math.isinf(total.item()) and math.isinf(per[1].item()) and math.isfinite(per[0].item())


def test_default_chunk_boundaries_cpu():
    c = ops.DEFAULT_CHUNK_SIZE
    xs = make_tensors([c - 1, c, c + 1], torch.bfloat16, "cpu")
    outs = [torch.empty_like(x, dtype=torch.float16) for x in xs]
    flag = ops.new_found_inf()
    ops.multi_tensor_scale_(xs, outs, 3.0, flag)
    for x, o in zip(xs, outs):
        assert torch.equal(o, (x.float() * 3.0).half())
    xs[2][c] = math.inf  # the one element of the last chunk
    ops.multi_tensor_scale_(xs, outs, 3.0, flag)
    assert flag.item() == 1.0


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_grid_and_cpu_agree_bitwise(dtype):
    xs = make_tensors(SIZE_CASES["many"] + SIZE_CASES["boundaries"], dtype, "cpu", seed=9)
    out_cpu = [torch.empty_like(x) for x in xs]
    out_grid = [torch.empty_like(x) for x in xs]
    ops.multi_tensor_axpby_(xs, xs, out_cpu, 0.3, 0.6, ops.new_found_inf(), chunk_size=CHUNK)
    _C.emulated.multi_tensor_axpby_(xs, xs, out_grid, torch.tensor([0.3]), torch.tensor([0.6]),
                                    ops.new_found_inf(), 3, CHUNK, 7, 11, 32)
    for a, b in zip(out_cpu, out_grid):
        assert torch.equal(a, b)


def _views_at(offset, sizes, dtype, seed):
    """Tensors of `sizes` as contiguous views `offset` elements into one flat buffer each (Apex's
    flattened-parameter layout): offset 0 keeps torch's alignment, an odd offset breaks it."""
    out = []
    for t in make_tensors(sizes, dtype, "cpu", seed=seed):
        buf = torch.zeros(t.numel() + offset + 8, dtype=dtype)
        view = buf[offset:offset + t.numel()]
        view.copy_(t)
        out.append(view)
    return out


# NOTE: [Aligned vector access]: the grid's blocks move four elements per list at once when every
# list's slice is aligned; misaligned views and the last n % 4 elements take the per-element path.
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("x_offset,out_offset,vectorised", [(0, 0, True), (1, 1, False),
                                                            (0, 3, False), (4, 4, True)])
def test_grid_vector_path_and_element_path_give_cpu_bits(dtype, x_offset, out_offset, vectorised):
    # sizes: multiples of 4, a tail of 1-3 elements, fewer than 4 elements, several chunks
    sizes = [4 * CHUNK, CHUNK + 3, 2, 3, 2 * CHUNK + 1, 7, 0, CHUNK - 1]
    xs = _views_at(x_offset, sizes, dtype, seed=13)
    outs_cpu = [torch.empty_like(x, dtype=torch.float32) for x in xs]
    outs_grid = _views_at(out_offset, sizes, torch.float32, seed=14)
    ops.multi_tensor_axpby_(xs, xs, outs_cpu, 0.3, -0.6, ops.new_found_inf(), chunk_size=CHUNK)
    _C.emulated.take_vectorised_blocks()
    _C.emulated.multi_tensor_axpby_(xs, xs, outs_grid, torch.tensor([0.3]), torch.tensor([-0.6]),
                                    ops.new_found_inf(), 3, CHUNK, 3, 4, 5)
    took = _C.emulated.take_vectorised_blocks()
    # aligned lists vectorise every block of at least 4 elements: 4 + 1 + 2 + 1 + 1 blocks
    assert took == (9 if vectorised else 0)
    for a, b, x in zip(outs_cpu, outs_grid, xs):
        assert torch.equal(a, b)
        assert_close_to_reference(b, x.double() * 0.3 - x.double() * 0.6, torch.float32)


@pytest.mark.parametrize("offset", [0, 1])
def test_grid_vector_path_flags_non_finite_in_a_group_and_in_the_tail(offset):
    sizes = [CHUNK + 3]
    for index in (5, CHUNK + 1):  # inside a 4-element group / in the chunk's 1-3 element tail
        xs = _views_at(offset, sizes, torch.bfloat16, seed=15)
        xs[0][index] = math.inf
        flag = ops.new_found_inf()
        _C.emulated.multi_tensor_scale_(xs, [torch.empty(CHUNK + 3)], torch.tensor([2.0]), flag,
                                        CHUNK, *Backend("grid_real")._grid(2))
        assert flag.item() == 1.0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_cuda_equals_cpu(dtype):
    xs = make_tensors(SIZE_CASES["many"] + SIZE_CASES["boundaries"], dtype, "cpu", seed=11)
    ys = [x.flip(0) for x in xs]
    outs = {}
    for dev in ("cpu", "cuda"):
        x = [t.to(dev) for t in xs]
        y = [t.to(dev) for t in ys]
        o = [torch.empty_like(t, dtype=torch.float32) for t in x]
        ops.multi_tensor_axpby_(x, y, o, 0.5, 0.25, ops.new_found_inf(dev), chunk_size=CHUNK)
        outs[dev] = [t.cpu() for t in o]
    for a, b in zip(outs["cpu"], outs["cuda"]):
        assert torch.equal(a, b)
