"""Shared test vocabulary: devices, dtypes with readable ids, per-dtype tolerances; small models
and their batches; state snapshots compared bit for bit; the poisoned loop (inf/NaN at chosen
steps, each skipped bit for bit, against a reference that omits them); the optimizer tests' shared
steps (a short training run, checkpoint resume in a new process). Every test directory's own
helpers (amp_helpers, dist_helpers, fault_helpers, torch_dialect_helpers) import these."""

import contextlib
import copy
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
        x, y = regression_batch(seed * 1000 + t, 16, 32, 8)
        x = x.to(next(model.parameters()).dtype)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# ---- small models and their data --------------------------------------------------------------
def make_mlp(seed=0, d_in=6, d_out=3, *, hidden=8, act=torch.nn.Tanh, dtype=None, device=None):
    """Linear(d_in, hidden) -> act -> Linear(hidden, d_out), initialized from ``seed``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), act(), torch.nn.Linear(hidden, d_out))
    return model if dtype is None and device is None else model.to(device=device, dtype=dtype)


def regression_batch(seed, n, d_in, d_out):
    """(x, y): standard normal (n, d_in) and (n, d_out), drawn in that order from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


def classification_batch(seed, n=16, shape=(3, 8, 8), num_classes=3):
    """(x, labels) drawn from ``seed``: x of shape (n, *shape), the label the channel (or feature)
    with the largest mean, so a model can learn it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g)
    if len(shape) == 3:
        y = x.mean(dim=(2, 3))[:, :num_classes].argmax(dim=1)
    else:
        y = x[:, :num_classes].argmax(dim=1)
    return x, y


# ---- state snapshots, compared bit for bit ------------------------------------------------------
def state_tensors(model, opt, held_params=True):
    """Copies, in a fixed order, of the weights and every optimizer state tensor: ``model``'s
    parameters (``model`` a module or a list of tensors), then for each parameter the optimizer
    holds the parameter itself (``held_params``: amp O2's fp32 master, else the weight again) and
    its state by key (numbers as 0-dim tensors, None left out). A list, for indexing, saving and
    zips."""
    params = model.parameters() if hasattr(model, "parameters") else model
    out = [p.detach().clone() for p in params]
    for group in opt.param_groups:
        for p in group["params"]:
            if held_params:
                out.append(p.detach().clone())
            st = opt.state.get(p, {})
            for k in sorted(st):
                v = st[k]
                if isinstance(v, torch.Tensor):
                    out.append(v.detach().clone())
                elif isinstance(v, (bool, int, float)):
                    out.append(torch.tensor(float(v)))
    return out


def snapshot(model, optimizer=None):
    """Deep copies of everything an optimizer step could change, as a dict for
    assert_bitwise_equal: the model's named parameters; with ``optimizer``, the parameters it holds
    (amp O2's fp32 masters) and its state_dict (state and param_groups)."""
    snap = {"model": {k: v.detach().clone() for k, v in model.named_parameters()}}
    if optimizer is not None:
        snap["params"] = [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]
        snap["opt"] = copy.deepcopy(optimizer.state_dict())
    return snap


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t):
    """A float tensor's bits as integers (NaN payloads and the sign of zero count); others as
    they are."""
    t = t.detach()
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.is_floating_point() else t


def assert_bitwise_equal(a, b, path=""):
    """``a`` and ``b`` the same bit for bit, recursively through dicts, lists and tuples: tensors
    of one dtype and shape with the same bits (a NaN equals only a NaN of the same payload, -0.0
    is not 0.0); anything else by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: a tensor vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if not torch.equal(_bits(a), _bits(b)):
            n = int((_bits(a) != _bits(b)).sum())
            diff = (a.detach().double() - b.detach().double()).abs().max().item()
            raise AssertionError(f"{path}: {n} of {a.numel()} elements differ in their bits "
                                 f"(max abs diff {diff})")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), \
            f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b)) if isinstance(b, dict) else b!r}"
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def bitwise_equal(a, b):
    """assert_bitwise_equal as a yes/no answer."""
    try:
        assert_bitwise_equal(a, b)
    except AssertionError:
        return False
    return True


# ---- the poisoned loop --------------------------------------------------------------------------
def assert_poisoned_steps_skipped(step, steps, poisoned, state, *, scale=None, backoff=0.5,
                                  skipped=None, clean_steps_change=False, reference_step=None,
                                  reference_state=None):
    """A training loop with inf/NaN injected at the steps of ``poisoned``, checked against what
    skipping them means. ``step(i, poison)`` runs step ``i`` of the run under test, writing inf or
    NaN into a gradient (or the loss, or the batch) when ``poison``, and returns what the test
    wants back (a loss, a scale). ``state()`` snapshots what a step may change (weights, masters, optimizer
    state: state_tensors or snapshot).

    At every poisoned step: the state after it is bit for bit the state before it, and ``scale()``
    (where given) is multiplied by ``backoff``. ``skipped()`` (where given) must say True exactly
    after the poisoned steps; ``clean_steps_change``: every other step changes the state.
    ``reference_step(i)`` (where given) is step ``i`` of a reference run that simply omits the
    poisoned steps: called after each clean step; with ``reference_state``, the run's final state
    equals ``reference_state()`` bit for bit. Returns the list of ``step``'s results."""
    results = []
    for i in range(steps):
        poison = i in poisoned
        before = state() if poison or clean_steps_change else None
        scale_before = scale() if poison and scale is not None else None
        results.append(step(i, poison))
        if poison:
            assert_bitwise_equal(state(), before, f"state after poisoned step {i}")
            if scale is not None:
                assert scale() == scale_before * backoff, (i, scale_before, scale())
        elif clean_steps_change:
            assert not bitwise_equal(state(), before), f"clean step {i} changed nothing"
        if skipped is not None:
            assert skipped() == poison, f"step {i}: skipped {skipped()}, poisoned {poison}"
        if reference_step is not None and not poison:
            reference_step(i)
    if reference_state is not None:
        assert_bitwise_equal(state(), reference_state(), "run vs reference")
    return results


def assert_grad_scaler_skips_bit_for_bit(model, opt, steps, bad_index, bad_value):
    """A GradScaler run of `steps` steps in which step 5's first gradient gets `bad_value` at
    `bad_index`: that step leaves weights and optimizer state bit for bit, and the run trains."""
    from peak import amp  # (not at import time: the tests' conftest checks the build first)
    scaler = amp.GradScaler("cpu", init_scale=2.0 ** 8)
    x, y = torch.randn(16, 32).to(torch.bfloat16), torch.randn(16, 8)

    def step(i, poison):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if poison:
            next(model.parameters()).grad[bad_index] = bad_value
        scaler.step(opt)
        scaler.update()
        return loss.item()

    losses = assert_poisoned_steps_skipped(step, steps, {5}, lambda: state_tensors(model, opt))
    assert losses[-1] < losses[0]


def assert_state_dict_resumes_bit_for_bit(make_model, make_opt):
    """5 steps, state_dicts saved, 5 more steps; a fresh model and optimizer loaded from the saved
    dicts then take the same 5 steps: weights and every state tensor equal bit for bit (dtypes
    too). Returns the first optimizer, for checks of its state."""
    model = make_model()
    opt = make_opt(model.parameters())
    train_steps(model, opt, 5)
    sd = copy.deepcopy(opt.state_dict())
    msd = copy.deepcopy(model.state_dict())
    train_steps(model, opt, 5, start=5)
    expected = state_tensors(model, opt)
    model2 = make_model(seed=9)
    model2.load_state_dict(msd)
    opt2 = make_opt(model2.parameters())
    opt2.load_state_dict(sd)
    train_steps(model2, opt2, 5, start=5)
    assert_bitwise_equal(state_tensors(model2, opt2), expected)
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


_HOST_READ_OPS = ("aten::_local_scalar_dense", "aten::is_nonzero")


class HostReads:
    """Counts host reads of tensors, each a device->host sync on CUDA: a TorchDispatchMode sees
    ``aten::_local_scalar_dense`` and ``aten::is_nonzero`` (``.item()``, ``bool()``,
    ``float()``...) and copies from a device to the CPU, from Python or C++ alike; ``.tolist()``
    is counted in Python (on the CPU it reads memory without an op). ``reads`` names each."""

    def __init__(self):
        self.reads = []
        self._in_tolist = False

    @property
    def count(self):
        return len(self.reads)

    @contextlib.contextmanager
    def counting(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = func.name()
                if counter._in_tolist:
                    pass
                elif name in _HOST_READ_OPS:
                    counter.reads.append(name)
                elif name in ("aten::_to_copy", "aten::copy_"):
                    src = args[1] if name == "aten::copy_" else args[0]
                    dst = args[0].device if name == "aten::copy_" else kwargs.get("device")
                    if (isinstance(src, torch.Tensor) and src.device.type != "cpu"
                            and dst is not None and torch.device(dst).type == "cpu"):
                        counter.reads.append(name)
                return func(*args, **kwargs)

        tolist = torch.Tensor.tolist

        def counted_tolist(t, *a, **k):
            self.reads.append("tolist")
            self._in_tolist = True
            try:
                return tolist(t, *a, **k)
            finally:
                self._in_tolist = False

        torch.Tensor.tolist = counted_tolist
        try:
            with Mode():
                yield self
        finally:
            torch.Tensor.tolist = tolist


@contextlib.contextmanager
def no_host_sync(device):
    """On CUDA, any device->host sync inside raises (``torch.cuda.set_sync_debug_mode("error")``);
    on the CPU, where nothing syncs, no host read of a tensor may happen inside (HostReads),
    which is what would sync on CUDA."""
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
        assert reads.count == 0, f"{reads.count} host reads: {reads.reads}"
