"""The multi-tensor ops on the real CUDA kernels, against the CPU kernels (bit for bit where the
design promises it) and float64 references. Every test is parametrized over a target: ``grid``
(the CUDA launcher's per-block code on the emulated grid, run here on the CPU: the same
comparisons, so the test logic is proven without a GPU) and ``cuda`` (skipped without one).

Where CPU and CUDA bits may differ (docs/core.md, "NaN bits on CUDA"): a NaN *computed* on the
GPU (any NaN that went through arithmetic, even ``x * 1``) is the GPU's canonical NaN, so fp32
and fp16 NaN results are NaNs on both sides but their sign and payload may differ; bf16 stores
every NaN as 0x7fc0 on every backend; the L2 norm sums in another order.
"""
import pytest
import torch

import peak
from peak import ops

from peak_testing import DTYPES, HAS_CUDA, assert_close_to_reference, dtype_id

_C = peak._C
CHUNK = 1024
TARGETS = ["grid", pytest.param("cuda", marks=pytest.mark.cuda)]
TINY_GRID = (3, 4, 5)  # tensors, blocks per launch, threads per block (the emulated grid's)
INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def bits(t):
    return t.contiguous().view(INT_VIEW[t.dtype]).cpu()


def patterns(dtype):
    """Special values of ``dtype`` as bit patterns: NaNs with payloads (quiet, signalling,
    negative), infinities, subnormals, the largest finite values, values that overflow or tie when
    rounded to a narrower type, signed zeros."""
    if dtype == torch.float32:
        raw = [0x7FC00001, 0x7FA00000, 0xFFC12345, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF,
               0x7F800000, 0xFF800000, 0x00000001, 0x80000001, 0x006D0000, 0x7F7FFFFF,
               0x477FF000, 0x477FEFFF, 0x33800000, 0x33000001, 0x3F808000, 0x3F818000,
               0x3F802000, 0x3F801000, 0x00000000, 0x80000000, 0x3F800000, 0xC0200000]
        return torch.tensor([r - 2**32 if r >= 2**31 else r for r in raw],
                            dtype=torch.int32).view(torch.float32)
    raw = ([0x7E01, 0x7C01, 0xFE55, 0x7FFF, 0x7C00, 0xFC00, 0x0001, 0x8001, 0x7BFF, 0x3C00,
            0x3C01, 0x0000, 0x8000] if dtype == torch.float16 else
           [0x7FC1, 0x7F81, 0xFFC5, 0x7FFF, 0x7F80, 0xFF80, 0x0001, 0x8001, 0x7F7F, 0x3F80,
            0x3F81, 0x0000, 0x8000])
    return torch.tensor([r - 2**16 if r >= 2**15 else r for r in raw],
                        dtype=torch.int16).view(dtype)


def special_lists(dtype, offset, device="cpu"):
    """The patterns repeated across chunk boundaries (one tensor of 3 chunks + 5, one of 31),
    as contiguous views ``offset`` elements into a flat buffer on ``device`` (odd: the
    per-element path)."""
    p = patterns(dtype)
    out = []
    for n in (3 * CHUNK + 5, 31):
        buf = torch.zeros(n + offset, dtype=dtype, device=device)
        reps = p.repeat(n // len(p) + 1)[:n]
        buf[offset:].copy_(reps)
        out.append(buf[offset:])
    return out


def scale_on(target, xs, outs, scale, found_inf, per_tensor=None):
    if target == "grid":
        _C.emulated.multi_tensor_scale_(xs, outs, torch.tensor([scale]), found_inf, CHUNK,
                                        *TINY_GRID, per_tensor_found_inf=per_tensor)
    else:
        ops.multi_tensor_scale_(xs, outs, scale, found_inf, chunk_size=CHUNK,
                                per_tensor_found_inf=per_tensor)


def target_device(target):
    return "cuda" if target == "cuda" else "cpu"


def assert_bits_match_cpu(target, ours, cpu):
    """Bit for bit, except NaN results on CUDA (any quiet NaN there; bf16: 0x7fc0 everywhere)."""
    a, b = bits(ours), bits(cpu)
    nan = torch.isnan(cpu.float().cpu())
    assert torch.equal(torch.isnan(ours.float().cpu()), nan)
    assert torch.equal(a[~nan], b[~nan]), (ours.dtype, (a != b).nonzero()[:5].flatten().tolist())
    if cpu.dtype == torch.bfloat16:
        assert (a[nan] == 0x7FC0).all() and (b[nan] == 0x7FC0).all()
    if target == "grid":
        assert torch.equal(a, b)  # the same host arithmetic: payloads included
    else:
        quiet = {torch.float32: 0x00400000, torch.float16: 0x0200, torch.bfloat16: 0x0040}
        assert ((a[nan] & quiet[cpu.dtype]) != 0).all()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "odd_offset"])
@pytest.mark.parametrize("dout", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("din", DTYPES, ids=dtype_id)
def test_special_value_bits_match_cpu(target, din, dout, offset):
    """NaN payloads, infinities, subnormals, overflow and ties through every load and store
    conversion of the grid, against the CPU kernels (NOTE: [fp16 NaN bits] in host_device.h)."""
    xs = special_lists(din, offset)
    cpu_out = [torch.empty_like(x, dtype=dout) for x in xs]
    cpu_found = ops.new_found_inf()
    ops.multi_tensor_scale_(xs, cpu_out, 1.0, cpu_found, chunk_size=CHUNK)
    dev = target_device(target)
    ys = special_lists(din, offset, dev)
    outs = special_lists(dout, offset, dev)  # overwritten; views at the same offset
    found = ops.new_found_inf(dev)
    per = torch.zeros(len(ys), device=dev)
    scale_on(target, ys, outs, 1.0, found, per)
    assert found.item() == 1.0 == cpu_found.item()
    assert per.tolist() == [1.0, 1.0]
    for o, c in zip(outs, cpu_out):
        assert_bits_match_cpu(target, o, c)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_finite_scaling_bits_match_cpu_and_reference(target, dtype):
    """Random values scaled by a non-power of two (a real rounding per element) into every
    output dtype: CPU bits, and within half an ulp of float64."""
    g = torch.Generator().manual_seed(5)
    sizes = [CHUNK * 3 + 1, 7, 1, CHUNK, 513, 4 * CHUNK - 3]
    xs = [(torch.randn(n, generator=g) * 300).to(dtype) for n in sizes]
    dev = target_device(target)
    for dout in DTYPES:
        cpu_out = [torch.empty_like(x, dtype=dout) for x in xs]
        ops.multi_tensor_scale_(xs, cpu_out, 0.37, ops.new_found_inf(), chunk_size=CHUNK)
        outs = [torch.empty(n, dtype=dout, device=dev) for n in sizes]
        found = ops.new_found_inf(dev)
        scale_on(target, [x.to(dev) for x in xs], outs, 0.37, found)
        assert found.item() == 0.0
        for o, c, x in zip(outs, cpu_out, xs):
            assert torch.equal(bits(o), bits(c))
            assert_close_to_reference(o.cpu(), x.double() * float(torch.tensor(0.37)), dout)


# Positions that straddle chunk and vector-group boundaries of a tensor of 3 chunks + 6.
POSITIONS = [0, 3, 4, CHUNK - 1, CHUNK, 2 * CHUNK + 1, 3 * CHUNK + 5]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=str)
@pytest.mark.parametrize("where", POSITIONS)
def test_non_finite_at_a_chosen_index_is_flagged_for_its_tensor_only(target, where, bad):
    dev = target_device(target)
    n_small = 40  # more tensors than one launch holds (tiny grid: 3; CUDA: 64 for depth 2)
    xs = [torch.randn(CHUNK // 2 + i, device=dev).half() for i in range(n_small)]
    big = torch.randn(3 * CHUNK + 6, device=dev).half()
    big[where] = bad
    xs.insert(17, big)
    outs = [torch.empty_like(x, dtype=torch.float32) for x in xs]
    found = ops.new_found_inf(dev)
    per = torch.zeros(len(xs), device=dev)
    scale_on(target, xs, outs, 0.5, found, per)
    assert found.item() == 1.0
    expect = torch.zeros(len(xs))
    expect[17] = 1.0
    assert torch.equal(per.cpu(), expect)
    ref = big.double().cpu() * 0.5
    got = outs[17].cpu()
    keep = torch.ones(len(ref), dtype=torch.bool)
    keep[where] = False
    assert_close_to_reference(got[keep], ref[keep], torch.float32)
    assert not torch.isfinite(got[where])
    if target == "cuda":  # check_finite_ (read only; no emulated twin) flags the same tensor
        found2 = ops.new_found_inf(dev)
        per2 = torch.zeros(len(xs), device=dev)
        ops.multi_tensor_check_finite_(xs, found2, chunk_size=CHUNK, per_tensor_found_inf=per2)
        assert found2.item() == 1.0 and torch.equal(per2.cpu(), expect)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_l2norm_many_tensors_straddling_launches_against_float64(target, dtype):
    """300 tensors (more than one launch's 136 slots: three launches) and one of 400 chunks:
    per-tensor and total norms within fp32 summation error of float64."""
    g = torch.Generator().manual_seed(7)
    sizes = [(i * 37) % 300 + 1 for i in range(300)] + [400 * CHUNK + 11]
    xs = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    dev = target_device(target)
    ys = [x.to(dev) for x in xs]
    if target == "grid":
        total, per = _C.emulated.multi_tensor_l2norm(ys, True, CHUNK, *TINY_GRID)
    else:
        total, per = ops.multi_tensor_l2norm(ys, per_tensor=True, chunk_size=CHUNK)
    ref_per = torch.stack([x.double().norm() for x in xs])
    ref_total = torch.cat([x.double().flatten() for x in xs]).norm()
    torch.testing.assert_close(per.cpu().double(), ref_per, rtol=5e-5, atol=0)
    torch.testing.assert_close(total.cpu().double().reshape(()), ref_total, rtol=5e-5, atol=0)


@pytest.mark.parametrize("target", TARGETS)
def test_axpby_mixed_dtypes_match_cpu_bits(target):
    g = torch.Generator().manual_seed(9)
    sizes = [2 * CHUNK + 3, 5, 700]
    xs = [torch.randn(n, generator=g).half() for n in sizes]
    ys = [torch.randn(n, generator=g).to(torch.bfloat16) for n in sizes]
    cpu_out = [torch.empty(n) for n in sizes]
    ops.multi_tensor_axpby_(xs, ys, cpu_out, 0.3, -1.7, ops.new_found_inf(), chunk_size=CHUNK)
    dev = target_device(target)
    outs = [torch.empty(n, device=dev) for n in sizes]
    found = ops.new_found_inf(dev)
    if target == "grid":
        _C.emulated.multi_tensor_axpby_(xs, ys, outs, torch.tensor([0.3]), torch.tensor([-1.7]),
                                        found, 3, CHUNK, *TINY_GRID)
    else:
        ops.multi_tensor_axpby_([x.cuda() for x in xs], [y.cuda() for y in ys], outs, 0.3, -1.7,
                                found, chunk_size=CHUNK)
    assert found.item() == 0.0
    for o, c in zip(outs, cpu_out):
        assert torch.equal(bits(o), bits(c))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_update_scale_sequence_matches_cpu(device):
    """The one-thread loss-scale kernel against the host function: 60 updates with hysteresis,
    a floor and a ceiling, the same scale and trackers after every one."""
    flags = [1 if (i * 7) % 5 == 0 or i in (30, 31, 32) else 0 for i in range(60)]
    states = {}
    for dev in ("cpu", device):
        scale = torch.full((1,), 2.0**10, device=dev)
        growth = torch.zeros(1, dtype=torch.int32, device=dev)
        hyst = torch.full((1,), 2, dtype=torch.int32, device=dev)
        trace = []
        for f in flags:
            found = torch.full((1,), float(f), device=dev)
            ops.update_scale_(scale, growth, found, 2.0, 0.5, 3, hysteresis_tracker=hyst,
                              hysteresis=2, min_scale=2.0**6, max_scale=2.0**12)
            trace.append((scale.item(), growth.item(), hyst.item()))
        states[dev] = trace
    assert states["cpu"] == states[device]


@pytest.mark.cuda
def test_cpu_argument_with_cuda_lists_gets_peaks_message():
    """Validation runs before the device guard: a CPU scalar among CUDA lists is named."""
    xs = [torch.ones(4, device="cuda")]
    with pytest.raises(RuntimeError, match="found_inf must be a .* on cuda"):
        ops.multi_tensor_scale_(xs, xs, torch.full((1,), 2.0, device="cuda"), torch.zeros(1))
    with pytest.raises(RuntimeError, match="found_inf must be a .* on cuda"):
        ops.multi_tensor_check_finite_(xs, torch.zeros(1))
    p = [torch.ones(4, device="cuda")]
    with pytest.raises(RuntimeError, match="lr must be a .* on cuda"):
        ops.fused_sgd_(p, [torch.ones(4, device="cuda")], [], [], [torch.zeros((), device="cuda")],
                       lr=torch.tensor([0.1]), momentum=0.0, dampening=0.0, weight_decay=0.0,
                       nesterov=False, maximize=False, grad_scale=None, found_inf=None)
    with pytest.raises(RuntimeError, match="one device"):
        ops.multi_tensor_l2norm([torch.ones(3), torch.ones(3, device="cuda")])
    # update_scale_: flags may be on any device, but a CUDA flag sends the call to the CUDA
    # kernels, which cannot update a scale in host memory
    scale, growth = torch.full((1,), 8.0), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="scale is on cpu but a found_infs flag is on a"):
        ops.update_scale_(scale, growth, [torch.ones(1, device="cuda")], 2.0, 0.5, 10)
    scale, growth = scale.cuda(), growth.cuda()  # the other way round is supported
    ops.update_scale_(scale, growth, [torch.ones(1), torch.zeros(1, device="cuda")], 2.0, 0.5, 10)
    assert scale.item() == 4.0


# ---------------------------------------------------------------- more than 2^31 elements
BIG = 2**31 + 1024


def need_gpu_memory(gib):
    if not HAS_CUDA:
        return
    free, _ = torch.cuda.mem_get_info()
    if free < gib * 2**30:
        pytest.skip(f"needs ~{gib} GiB of free GPU memory, {free / 2**30:.1f} GiB free")


@pytest.mark.cuda
def test_more_than_2_31_elements_in_one_tensor():
    """One bf16 tensor of 2^31 + 1024 elements (~4 GiB; ~9 GiB in all): the scale and check reach
    every element past 2^31 (64-bit indexing), and the L2 norm counts them."""
    need_gpu_memory(10)
    x = torch.zeros(BIG, dtype=torch.bfloat16, device="cuda")
    tail = torch.arange(1, 1025, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    x[2**31:] = tail
    x[5] = 3.0
    found = ops.new_found_inf("cuda")
    ops.multi_tensor_scale_([x], [x], 2.0, found)  # in place
    assert found.item() == 0.0
    assert torch.equal(x[2**31:].float(), tail.float() * 2)
    assert x[5].item() == 6.0 and x[2**31 - 1].item() == 0.0
    total, per = ops.multi_tensor_l2norm([x], per_tensor=True)
    ref = (4 * tail.double().square().sum().item() + 36) ** 0.5  # (bf16 rounded the tail)
    assert abs(total.item() - ref) <= 1e-5 * ref and abs(per.item() - ref) <= 1e-5 * ref
    x[BIG - 1] = float("nan")
    found.zero_()
    ops.multi_tensor_check_finite_([x], found)
    assert found.item() == 1.0
    del x
    torch.cuda.empty_cache()


@pytest.mark.cuda
def test_more_than_2_31_elements_in_an_optimizer_step():
    """FusedSGD on one bf16 parameter of 2^31 + 1024 elements (fp32 master as remainders and
    8-bit momentum: ~12 GiB): the elements past 2^31 step as the first ones do."""
    from peak.optimizers import FusedSGD
    need_gpu_memory(16)
    p = torch.nn.Parameter(torch.ones(BIG, dtype=torch.bfloat16, device="cuda"))
    p.grad = torch.ones_like(p)
    p.grad[2**31:] = 2.0
    opt = FusedSGD([p], lr=0.25, momentum=0.9, store_param_remainders=True,
                   momentum_dtype=torch.uint8)
    opt.step()
    w = p.detach()
    assert w[0].item() == 0.75 and w[2**31 - 1].item() == 0.75
    assert torch.equal(w[2**31:].float(), torch.full((1024,), 0.5, device="cuda"))
    st = opt.state[p]
    assert st["momentum_buffer_scale"].numel() == (BIG + 255) // 256
    assert st["momentum_buffer_scale"][-1].item() == 2.0
    del p, opt, st, w
    torch.cuda.empty_cache()
