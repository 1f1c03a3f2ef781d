"""Shared test vocabulary: devices, dtypes with readable ids, per-dtype tolerances, and the
optimizer tests' shared steps (a short training run, the state's bits, checkpoint resume in a new
process, a GradScaler-skipped step)."""

import contextlib
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
             torch.float64: "f64"}

# Tolerances for results computed in fp32 and rounded once to the output dtype, compared with a
# float64 reference: half an ulp of the output dtype plus fp32 rounding on the way.
TOLERANCES = {
    torch.float32: dict(rtol=2e-6, atol=1e-30),
    torch.float16: dict(rtol=1e-3, atol=1e-7),
    torch.bfloat16: dict(rtol=8e-3, atol=1e-30),
}

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + [pytest.param("cuda", marks=pytest.mark.cuda)]


def dtype_id(dt):
    return DTYPE_IDS[dt]


def assert_close_to_reference(actual, reference, dtype=None):
    """``actual`` against a float64 ``reference`` with the tolerance of ``dtype``."""
    dtype = dtype or actual.dtype
    torch.testing.assert_close(actual.double(), reference.double(), **TOLERANCES[dtype],
                               equal_nan=True)


def opcheck_op(op, args, kwargs=None, **options):
    """torch.library.opcheck over one of peak's ops, with the arguments written in schema order:
    the ones the schema makes keyword-only (NOTE: [Keyword-only scalars] in csrc/ops/schemas.h)
    are passed by name."""
    arguments = op._schema.arguments
    npos = sum(not a.kwarg_only for a in arguments)
    named = dict(zip([a.name for a in arguments if a.kwarg_only], args[npos:]))
    overlap = set(named) & set(kwargs or {})
    assert not overlap, f"given both positionally and by name: {sorted(overlap)}"
    named.update(kwargs or {})
    return torch.library.opcheck(op, tuple(args[:npos]), named, **options)


# A worker run twice: "save" steps every case 6 times and saves params and optimizer state;
# "load" restores them in a new process and steps 5 more times. `module` (a test file's name)
# gives RESUME_CASES and make_resumable(*case); `run` is test_fused_optimizers.run.
_RESUME_SCRIPT = textwrap.dedent("""
    import importlib, sys, torch
    sys.path[:0] = [{tests!r}, {tests!r} + "/.."]
    module = importlib.import_module({module!r})
    from test_fused_optimizers import run
    torch.set_num_threads(1)
    mode, path = sys.argv[1], sys.argv[2]
    saved = torch.load(path) if mode == "load" else {{}}
    out = {{}}
    for case in module.RESUME_CASES:
        params, opt = module.make_resumable(*case)
        if mode == "save":
            run(opt, params, 6)
            out[case] = {{"params": [p.detach() for p in params], "opt": opt.state_dict()}}
        else:
            with torch.no_grad():
                for p, v in zip(params, saved[case]["params"]):
                    p.copy_(v)
            opt.load_state_dict(saved[case]["opt"])
            run(opt, params, 5, seed=2)
            out[case] = [p.detach() for p in params]
    torch.save(out, path if mode == "save" else path + ".out")
""")


def assert_resumes_bit_for_bit_in_a_new_process(tmp_path, test_file, cases, make_resumable, run):
    """6 steps, save, load in a NEW process, 5 more steps == 11 uninterrupted steps, bitwise, for
    every case of the test file (its RESUME_CASES and make_resumable)."""
    test_file = pathlib.Path(test_file)
    script = tmp_path / "resume.py"
    script.write_text(_RESUME_SCRIPT.format(tests=str(test_file.parent), module=test_file.stem))
    ck = str(tmp_path / "ck.pt")
    for mode in ("save", "load"):
        subprocess.run([sys.executable, str(script), mode, ck], check=True)
    resumed = torch.load(ck + ".out")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same reduction order as the worker processes
    try:
        for case in cases:
            params, opt = make_resumable(*case)
            run(opt, params, 6)
            run(opt, params, 5, seed=2)
            for p, r in zip(params, resumed[case]):
                assert torch.equal(p.detach(), r), case
    finally:
        torch.set_num_threads(threads)


def train_steps(model, opt, steps, seed=1, start=0):
    """`steps` plain steps (mse loss on seeded random data, step t's data from seed and t)."""
    losses = []
    for t in range(start, start + steps):
        g = torch.Generator().manual_seed(seed * 1000 + t)
        x = torch.randn(16, 32, generator=g).to(next(model.parameters()).dtype)
        y = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def state_bits(model, opt):
    """Copies of the weights and of every optimizer state tensor, for bitwise comparisons."""
    out = [p.detach().clone() for p in model.parameters()]
    for st in opt.state.values():
        out += [v.clone() for k, v in sorted(st.items())]
    return out


def assert_grad_scaler_skips_bit_for_bit(model, opt, steps, bad_index, bad_value):
    """A GradScaler run of `steps` steps in which step 5's first gradient gets `bad_value` at
    `bad_index`: that step leaves weights and optimizer state bit for bit, and the run trains."""
    from peak import amp  # (not at import time: the tests' conftest checks the build first)
    scaler = amp.GradScaler("cpu", init_scale=2.0 ** 8)
    x, y = torch.randn(16, 32).to(torch.bfloat16), torch.randn(16, 8)
    losses = []
    for i in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if i == 5:
            next(model.parameters()).grad[bad_index] = bad_value
            before = state_bits(model, opt)
        scaler.step(opt)
        scaler.update()
        if i == 5:
            for a, b in zip(before, state_bits(model, opt)):
                assert torch.equal(a, b)
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def assert_state_dict_resumes_bit_for_bit(make_model, make_opt):
    """5 steps, state_dicts saved, 5 more steps; a fresh model and optimizer loaded from the saved
    dicts then take the same 5 steps: weights and every state tensor equal bit for bit (dtypes
    too). Returns the first optimizer, for checks of its state."""
    import copy
    model = make_model()
    opt = make_opt(model.parameters())
    train_steps(model, opt, 5)
    sd = copy.deepcopy(opt.state_dict())
    msd = copy.deepcopy(model.state_dict())
    train_steps(model, opt, 5, start=5)
    expected = state_bits(model, opt)
    model2 = make_model(seed=9)
    model2.load_state_dict(msd)
    opt2 = make_opt(model2.parameters())
    opt2.load_state_dict(sd)
    train_steps(model2, opt2, 5, start=5)
    got = state_bits(model2, opt2)
    assert len(got) == len(expected)
    for a, b in zip(expected, got):
        assert a.dtype == b.dtype and torch.equal(a, b)
    return opt


def step_on_cpu_and_emulated_grid(grid, dtype, with_master, state, call):
    """The shape the emulated-grid optimizer tests share: 40 tensors (1 to 200 elements, seed 3),
    4 steps of seeded gradients with step 2 skipped (found_inf), run once by the CPU launcher
    (torch.ops.peak) and once by the CUDA launcher's per-block code on the emulated grid of shape
    `grid` (torch.ops.peak_emulated). `state(sizes)` makes a fresh state dict; `call(ns, params,
    grads, masters, state, lr, found)` runs one step. Returns {ns: (params, masters, state)}."""
    import peak
    g = torch.Generator().manual_seed(3)
    sizes = [((i * 53) % 200) + 1 for i in range(40)]
    base = [torch.randn(n, generator=g).to(dtype) for n in sizes]
    runs = {}
    peak._C.emulated.set_grid_shape(*grid)
    try:
        for ns in ("peak", "peak_emulated"):
            params = [b.clone() for b in base]
            masters = [b.float().clone() for b in base] if with_master else []
            st = state(sizes)
            lr = torch.tensor([1e-2])
            for step in range(4):
                gg = torch.Generator().manual_seed(100 + step)
                grads = [torch.randn(n, generator=gg).to(dtype) * 4 for n in sizes]
                found = torch.tensor([1.0 if step == 2 else 0.0])
                call(ns, params, grads, masters, st, lr, found)
            runs[ns] = (params, masters, st)
    finally:
        peak._C.emulated.set_grid_shape(0, 0, 0)
    return runs


def amp_steps(model, opt, data):
    """One amp step (zero_grad, mse loss, scale_loss, backward, step) per (x, y) in `data`."""
    from peak import amp
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()


class HostReads:
    """Counts Python-level host reads of tensors (``.item()``, ``.tolist()``, ``bool()``,
    ``float()``, ``int()``): on CUDA each is a device->host sync."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__")

    def __init__(self):
        self.count = 0

    @contextlib.contextmanager
    def counting(self):
        originals = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def wrap(fn):
            def counted(t, *a, **k):
                self.count += 1
                return fn(t, *a, **k)
            return counted

        for n, fn in originals.items():
            setattr(torch.Tensor, n, wrap(fn))
        try:
            yield self
        finally:
            for n, fn in originals.items():
                setattr(torch.Tensor, n, fn)


@contextlib.contextmanager
def no_host_sync(device):
    """On CUDA, any device->host sync inside raises (``torch.cuda.set_sync_debug_mode("error")``);
    on the CPU, where nothing syncs, no Python-level host read of a tensor may happen inside
    (HostReads), which is what would sync on CUDA."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
    else:
        reads = HostReads()
        with reads.counting():
            yield
        assert reads.count == 0, f"{reads.count} host reads"
