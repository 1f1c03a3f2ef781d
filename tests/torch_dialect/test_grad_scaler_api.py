"""peak.amp.GradScaler: torch's contract (errors, state machine, unscale cases, update sequences,
disabled / lazy behaviour, fused hand-off) and peak's extensions (hysteresis, min/max scale and the
floor policy, skipped-step visibility, overflow attribution, fp16/bf16 gradients)."""
import copy
import warnings

import pytest
import torch

from peak import amp
from peak.amp.grad_scaler import OptState, _refresh_per_optimizer_state
from peak_testing import (DEVICES, DTYPES, HostReads, assert_poisoned_steps_skipped, dtype_id,
                          state_tensors)
from torch_dialect_helpers import batches, make_model

F = torch.nn.functional
INF, NAN = float("inf"), float("nan")


def opt_with_grads(grads, dtype=None):
    """An SGD optimizer over parameters whose .grad are the given tensors (set as they are)."""
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(g.shape, dtype=dtype or g.dtype, device=g.device))
        p.grad = g
        params.append(p)
    return torch.optim.SGD(params, lr=1.0)


def scaler_at(scale, device="cpu", **kw):
    s = amp.GradScaler(device, init_scale=scale, **kw)
    s.scale(torch.ones((), device=device))  # lazily creates the state on that device
    return s


def train_step(scaler, model, opt, x, y):
    opt.zero_grad()
    scaler.scale(F.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()


# ---- construction -------------------------------------------------------------------------------

def test_defaults_and_lazy_state():
    s = amp.GradScaler("cpu")
    assert s.get_scale() == 2.0**16 and s._scale is None and s._growth_tracker is None
    assert (s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()) == (2.0, 0.5, 2000)
    assert s.is_enabled()
    assert s._per_optimizer_states[0] == _refresh_per_optimizer_state()
    out = s.scale(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0**16))
    assert s._scale.shape == () and s._scale.dtype == torch.float32
    assert s._growth_tracker.shape == () and s._growth_tracker.dtype == torch.int32
    assert s._scale.device.type == "cpu"


def test_default_device_cuda_without_cuda_warns_and_disables_like_torch():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.warns(UserWarning, match="CUDA is not available.  Disabling.") as rec_p:
        s = amp.GradScaler()
    with pytest.warns(UserWarning) as rec_t:
        torch.amp.GradScaler()
    assert str(rec_p[0].message) == str(rec_t[0].message)
    assert not s.is_enabled()
    loss = torch.ones(())
    assert s.scale(loss) is loss and s.get_scale() == 1.0 and s.state_dict() == {}


def test_disabled_scaler_is_a_pass_through():
    m = make_model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = amp.GradScaler("cpu", enabled=False)
    x, y = batches(1)[0]
    loss = F.mse_loss(m(x), y)
    assert s.scale(loss) is loss
    loss.backward()
    assert s.step(o) is None and s.last_step_skipped is False
    s.unscale_(o)
    s.update()
    s.load_state_dict({})
    assert s.state_dict() == {} and s.skipped_steps == 0


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(growth_factor=1.0), AssertionError, "growth factor must be > 1.0"),
    (dict(backoff_factor=1.0), AssertionError, "backoff factor must be < 1.0"),
    (dict(growth_factor=0.5), ValueError, "growth factor"),
    (dict(init_scale=0.0), ValueError, "init_scale"),
    (dict(init_scale=float("inf")), ValueError, "init_scale"),
    # (1/1e-40 is inf in float32: every gradient would unscale to inf or NaN)
    (dict(init_scale=1e-40), ValueError, r"init_scale must be finite and >= 2\*\*-127"),
    (dict(init_scale="big"), TypeError, "init_scale must be a float"),
    (dict(growth_interval=0), ValueError, r"growth_interval must be in \[1, 2\*\*31 - 1\]"),
    (dict(growth_interval=2**32 + 1), ValueError, r"growth_interval must be in \[1, 2\*\*31 - 1\]"),  # (an int32 counter would wrap)
    (dict(growth_interval=2.5), TypeError, "growth_interval must be an int"),
    (dict(hysteresis=0), ValueError, r"hysteresis must be in \[1, 2\*\*31 - 1\]"),
    (dict(growth_factor=float("nan")), AssertionError, "growth factor must be > 1.0"),
    (dict(min_scale=2.0**20), ValueError, "min_scale=.* must be in"),
    (dict(max_scale=1.0), ValueError, "max_scale=.* must be >= init_scale"),
    (dict(on_min_scale="ignore"), ValueError, "on_min_scale must be one of"),
    (dict(device="gpu0"), ValueError, "device='gpu0' is not a device type"),
])
def test_bad_constructor_arguments(kwargs, exc, match):
    kwargs.setdefault("device", "cpu")
    with pytest.raises(exc, match=match):
        amp.GradScaler(**kwargs)


@pytest.mark.parametrize("change, exc, match", [
    (dict(min_scale=1e9), ValueError, r"min_scale=1000000000.0 must be in \[0, scale=65536.0\]"),
    (dict(max_scale=1.0), ValueError, "max_scale=1.0 must be >= scale"),
    (dict(_hysteresis_tracker=7), ValueError, r"_hysteresis_tracker=7 must be in \[0, 1\]"),
    (dict(_growth_tracker=-1), ValueError, r"_growth_tracker=-1 must be in \[0, inf\]"),
    (dict(_skipped_steps=-3), ValueError, "_skipped_steps=-3"),
    (dict(growth_factor=0.5), AssertionError, "growth factor must be > 1.0"),
    (dict(scale=float("inf")), ValueError, r"GradScaler: scale must be finite and >= 2\*\*-127 "
                                           r"\(5.9e-39\), got inf"),
    (dict(scale=0.0), ValueError, r"GradScaler: scale must be finite and >= 2\*\*-127"),
    (dict(scale=1e-40), ValueError, r"GradScaler: scale must be finite and >= 2\*\*-127"),
    (dict(scale=2.0 ** -128), ValueError, r"GradScaler: scale must be finite and >= 2\*\*-127"),
    (dict(scale="a"), TypeError, "GradScaler: scale must be a float, got str"),
    (dict(growth_interval=0), ValueError, r"growth_interval must be in \[1, 2\*\*31 - 1\]"),
    (dict(growth_interval=2**31), ValueError, r"growth_interval must be in \[1, 2\*\*31 - 1\]"),
    (dict(hysteresis=0), ValueError, r"hysteresis must be in \[1, 2\*\*31 - 1\]"),
])
def test_a_damaged_state_dict_is_refused_before_anything_changes(change, exc, match):
    """What the constructor refuses, load_state_dict refuses too, naming the entry; the scaler
    (here mid-run: its tensors exist) keeps its state and trains on as if nothing was tried."""
    m = make_model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = amp.GradScaler("cpu", hysteresis=1, growth_interval=3)
    reference = amp.GradScaler("cpu", hysteresis=1, growth_interval=3)
    for scaler in (s, reference):
        for x, y in batches(2):
            scaler.scale(F.mse_loss(m(x), y)).backward()
            scaler.unscale_(o)
            scaler.update()
            o.zero_grad()
    good = s.state_dict()
    with pytest.raises(exc, match=match) as info:
        s.load_state_dict({**good, **change})
    assert "GradScaler.load_state_dict" in str(info.value) and "nothing was loaded" in str(info.value)
    assert s.state_dict() == good == reference.state_dict()


def test_a_torch_state_outside_the_scalers_own_bounds_loads():
    """A torch state carries no bounds: it is not held to the bounds this scaler was built with
    (a floor added after torch's scale collapsed), which apply from the next update."""
    t = torch.amp.GradScaler("cpu", init_scale=0.5)
    t._lazy_init_scale_growth_tracker(torch.device("cpu"))
    s = amp.GradScaler("cpu", min_scale=1.0, init_scale=2.0)
    s.load_state_dict(t.state_dict())
    assert s.get_scale() == 0.5 and s.state_dict()["min_scale"] == 1.0
    big = amp.GradScaler("cpu", init_scale=2.0 ** 8, max_scale=2.0 ** 10)
    big.load_state_dict(torch.amp.GradScaler("cpu").state_dict())
    assert big.get_scale() == 65536.0 and big.state_dict()["max_scale"] == 1024.0


def test_a_torch_state_past_a_lowered_growth_interval_loads():
    """torch's set_growth_interval may leave its tracker above the new interval: torch saves it
    so, and peak loads it."""
    t = torch.amp.GradScaler("cpu", growth_interval=10)
    t._lazy_init_scale_growth_tracker(torch.device("cpu"))
    t._growth_tracker.fill_(7)
    t.set_growth_interval(4)
    s = amp.GradScaler("cpu")
    s.load_state_dict(t.state_dict())
    assert s.state_dict()["_growth_tracker"] == 7 and s.get_growth_interval() == 4


def test_constructor_takes_what_torch_takes():
    """numpy scalars, any truthy ``enabled``; a disabled scaler checks nothing (as torch)."""
    import numpy as np
    for kw in (dict(enabled=1), dict(enabled=None), dict(init_scale=np.float32(1024.0)),
               dict(growth_interval=np.int64(10)), dict(init_scale=torch.tensor(8.0)),
               dict(enabled=False, init_scale="big", growth_interval=2.5)):
        ours = amp.GradScaler("cpu", **kw)
        theirs = torch.amp.GradScaler("cpu", **kw)
        assert bool(ours.is_enabled()) == bool(theirs.is_enabled()), kw
        if ours.is_enabled():
            ours.scale(torch.ones(()))
            theirs.scale(torch.ones(()))
            assert ours.get_scale() == theirs.get_scale()
            assert ours.get_growth_interval() == theirs.get_growth_interval()


# ---- state machine and errors (torch's messages) --------------------------------------------------

def test_errors_before_scale():
    s = amp.GradScaler("cpu")
    o = opt_with_grads([torch.ones(2)])
    for call, name in ((lambda: s.unscale_(o), "unscale_"), (lambda: s.step(o), "step"),
                       (lambda: s.update(), "update")):
        with pytest.raises(AssertionError, match=f"Attempted {name} but _scale is None"):
            call()


def test_state_machine_errors():
    s = scaler_at(4.0)
    o = opt_with_grads([torch.ones(2)])
    s.unscale_(o)
    assert s._per_optimizer_states[id(o)]["stage"] is OptState.UNSCALED
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called on this optimizer"):
        s.unscale_(o)
    s.step(o)
    assert s._per_optimizer_states[id(o)]["stage"] is OptState.STEPPED
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)"):
        s.unscale_(o)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update"):
        s.step(o)
    s.update()
    assert len(s._per_optimizer_states) == 0


def test_closure_and_no_inf_checks():
    s = scaler_at(4.0)
    o = opt_with_grads([torch.ones(2)])
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        s.step(o, closure=lambda: 0.0)
    no_grads = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer."):
        s.step(no_grads)
    s2 = scaler_at(4.0)
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update."):
        s2.update()
    model = make_model()
    for call in (s2.unscale_, s2.step):
        with pytest.raises(TypeError, match="pass the optimizer, not the model"):
            call(model)


def test_a_torch_scaler_that_backed_off_to_2_to_the_minus_127_loads_and_trains():
    """torch's scaler reaches 2**-127 after 143 overflows in a row (from 2**16) and still steps
    right there (1/2**-127 is finite); peak loads that state and trains as torch does. The next
    backoff, 2**-128, has no finite reciprocal: torch's next clean step writes inf/NaN."""
    def run(scaler_cls, state):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s = scaler_cls("cpu")
        s.load_state_dict(state)
        s.scale(model(torch.ones(3, 4)).pow(2).sum() * 2.0 ** 100).backward()
        s.step(opt)
        s.update()
        return model.weight.detach().clone(), s.get_scale()
    state = torch.amp.GradScaler("cpu").state_dict() | {"scale": 2.0 ** -127}
    theirs, ours = run(torch.amp.GradScaler, state), run(amp.GradScaler, state)
    assert torch.isfinite(theirs[0]).all() and torch.equal(theirs[0], ours[0])
    assert theirs[1] == ours[1]
    with pytest.raises(ValueError, match=r"scale must be finite and >= 2\*\*-127"):
        amp.GradScaler("cpu").load_state_dict(state | {"scale": 2.0 ** -128})


def test_update_new_scale():
    s = scaler_at(4.0)
    s.update(8.0)
    assert s.get_scale() == 8.0
    s.update(torch.tensor([16.0]))
    assert s.get_scale() == 16.0
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor(1.0, requires_grad=True)):
        with pytest.raises(AssertionError, match="new_scale should be a float or a 1-element"):
            s.update(bad)
    with pytest.raises(TypeError, match="new_scale should be a float"):
        s.update("2")
    # A scale the next step would unscale by 1/0 or 1/1e-40 (inf in float32): torch takes it and
    # NaNs the weights at the next clean step; peak refuses it, keeping the scale it had.
    for bad in (0.0, 1e-40, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"update: new_scale must be finite and >= 2\*\*-127"):
            s.update(bad)
        assert s.get_scale() == 16.0
    # A tensor is not read on the host: a scale below 2**-127 is raised to it on the device, so
    # the next clean step's gradients stay finite.
    tiny = 2.0 ** -127
    for low in (torch.tensor(0.0), torch.tensor([1e-40]), torch.tensor(-3.0),
                torch.tensor(0.0, dtype=torch.float16), torch.tensor(0)):
        s.update(low)
        assert s.get_scale() == tiny and s._scale.dtype == torch.float32
        s.update(torch.tensor(2.0 ** 20, dtype=torch.float64))
        assert s.get_scale() == 2.0 ** 20


def test_scale_nested_outputs():
    s = scaler_at(2.0)
    a, b, c = torch.ones(2), torch.full((3,), 2.0), torch.full((1,), 3.0)
    out = s.scale([a, (b, [c])])
    assert isinstance(out, list) and isinstance(out[1], tuple)
    assert torch.equal(out[0], a * 2) and torch.equal(out[1][1][0], c * 2)
    it = s.scale(iter([a, b]))
    assert not isinstance(it, (list, tuple)) and torch.equal(list(it)[1], b * 2)
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        s.scale(1.0)


# ---- unscale (torch's test_grad_scaling_unscale, every kernel dtype) -----------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced", "mixed"])
@pytest.mark.parametrize("bad", [None, INF, NAN], ids=["finite", "inf", "nan"])
def test_unscale_cases(device, dtype, layout, bad):
    def grad(i):
        if layout == "transposed" or (layout == "mixed" and i == 1):
            return torch.full((3, 4), 4.0, dtype=dtype, device=device).t()
        if layout == "sliced" or (layout == "mixed" and i == 2):
            return torch.full((4, 6), 4.0, dtype=dtype, device=device)[:, :3]
        return torch.full((4, 3), 4.0, dtype=dtype, device=device)

    grads = [grad(i) for i in range(3)]
    backing = [g._base for g in grads if g._base is not None]
    if bad is not None:
        grads[2][1, 1] = bad
    o = opt_with_grads(grads)
    s = scaler_at(4.0, device)
    s.unscale_(o)
    found = s._found_inf_per_device(o)[grads[0].device]
    assert found.item() == (0.0 if bad is None else 1.0)
    for i, p in enumerate(o.param_groups[0]["params"]):
        assert p.grad is grads[i]  # in place
        expected = torch.ones(4, 3, dtype=dtype, device=device)
        if bad is not None and i == 2:
            expected[1, 1] = bad
        torch.testing.assert_close(p.grad, expected, equal_nan=True, rtol=0, atol=0)
    for b in backing:  # the memory a slice does not cover is untouched
        if b.shape == (4, 6):
            assert torch.equal(b[:, 3:], torch.full((4, 3), 4.0, dtype=dtype, device=device))


def test_unscale_mixed_dtypes_and_float64():
    grads = [torch.full((5,), 8.0), torch.full((5,), 8.0, dtype=torch.float16),
             torch.full((5,), 8.0, dtype=torch.bfloat16), torch.full((5,), 8.0, dtype=torch.float64)]
    o = opt_with_grads(grads)
    s = scaler_at(8.0)
    s.unscale_(o)
    for g in grads:
        assert torch.equal(g, torch.ones(5, dtype=g.dtype))
    grads[3][0] = INF
    o2 = opt_with_grads([grads[3]])
    s2 = scaler_at(2.0)
    s2.unscale_(o2)
    assert s2._found_inf_per_device(o2)[torch.device("cpu")].item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_unscale_low_precision_grads_fp32_math(dtype):
    """fp16/bf16 gradients (torch: "Attempting to unscale FP16 gradients"): x * (1/S) in fp32,
    rounded once to the gradient's dtype."""
    torch.manual_seed(0)
    g = (torch.randn(1000) * 100).to(dtype)
    expected = (g.float() * torch.tensor(3.0).double().reciprocal().float()).to(dtype)
    o = opt_with_grads([g.clone()])
    s = scaler_at(3.0)
    s.unscale_(o)
    assert torch.equal(o.param_groups[0]["params"][0].grad, expected)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        ts = torch.amp.GradScaler("cpu", init_scale=3.0)
        ts.scale(torch.ones(()))
        ts.unscale_(opt_with_grads([torch.ones(2, dtype=torch.float16)]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_half_model_training(dtype):
    """A model in fp16/bf16 with plain SGD: steps work, overflow skips, parameters match a
    reference that unscales in fp32 by hand."""
    m = make_model(dtype=dtype)
    ref = make_model(dtype=dtype)
    o, o_ref = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    s = amp.GradScaler("cpu", init_scale=256.0, growth_interval=1000)
    poisoned = {2}  # an inf in the batch's input
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(6, inf_at=poisoned)]
    scales = []

    def step(i, poison):
        x, y = data[i]
        scales.append(s.get_scale())
        o.zero_grad()
        s.scale(F.mse_loss(m(x), y)).backward()
        s.step(o)
        s.update()

    def reference_step(i):
        x, y = data[i]
        o_ref.zero_grad()
        (F.mse_loss(ref(x), y) * torch.tensor(scales[i])).backward()
        for p in ref.parameters():
            p.grad = (p.grad.float() * (1 / scales[i])).to(dtype)
        o_ref.step()

    assert_poisoned_steps_skipped(step, 6, poisoned, lambda: state_tensors(m, o),
                                  skipped=lambda: s.last_step_skipped, reference_step=reference_step,
                                  reference_state=lambda: state_tensors(ref, o_ref))


def test_sparse_gradients():
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    v = torch.tensor([3, 4, 5], dtype=torch.float32)
    g = torch.sparse_coo_tensor(i, v, (2, 3), check_invariants=True)
    o = opt_with_grads([g.clone()])
    s = scaler_at(2.0)
    s.unscale_(o)
    torch.testing.assert_close(o.param_groups[0]["params"][0].grad.to_dense(), g.to_dense() / 2)
    # fp16: duplicate indices that overflow only once summed (torch's 64000 + 64000 case)
    i = torch.tensor([[0, 0], [1, 1]])
    v = torch.tensor([64000.0, 64000.0], dtype=torch.float16)
    o = opt_with_grads([torch.sparse_coo_tensor(i, v, (2, 3), check_invariants=True)])
    s = scaler_at(1.0)
    s.unscale_(o)
    assert s._found_inf_per_device(o)[torch.device("cpu")].item() == 1.0


# ---- update sequences ---------------------------------------------------------------------------

def _drive(scaler, flags):
    """Run update() after recording the given found_inf values; return the scales seen."""
    o = opt_with_grads([torch.ones(1)])
    out = []
    for f in flags:
        o.param_groups[0]["params"][0].grad = torch.tensor([INF if f else 1.0])
        scaler.scale(torch.ones(()))
        scaler.step(o)
        scaler.update()
        out.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return out


def test_update_scale_sequence_like_torch():
    """torch's test_grad_scaling_update_scale: growth 2, backoff 0.25, interval 2."""
    s = amp.GradScaler("cpu", init_scale=2.0, growth_factor=2.0, backoff_factor=0.25,
                       growth_interval=2)
    seq = _drive(s, [0, 0, 1])
    assert seq == [(2.0, 1), (4.0, 0), (1.0, 0)]


def test_update_random_sequences_match_torch():
    g = torch.Generator().manual_seed(5)
    flags = (torch.rand(200, generator=g) < 0.2).tolist()
    kw = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ours = _drive(amp.GradScaler("cpu", **kw), flags)
    ts = torch.amp.GradScaler("cpu", **kw)
    theirs = []
    for f in flags:
        ts.scale(torch.ones(()))
        ts._scale  # noqa: B018
        found = torch.tensor(1.0 if f else 0.0)
        torch._amp_update_scale_(ts._scale, ts._growth_tracker, found, 2.0, 0.5, 3)
        theirs.append((ts.get_scale(), ts._get_growth_tracker()))
    assert ours == theirs


def test_hysteresis_sequence():
    s = amp.GradScaler("cpu", init_scale=64.0, growth_interval=100, hysteresis=2)
    seq = [sc for sc, _ in _drive(s, [1, 0, 1, 1, 1, 0, 1])]
    # first overflow tolerated; a clean step refills; two in a row back off, a third at once
    assert seq == [64.0, 64.0, 64.0, 32.0, 16.0, 16.0, 16.0]
    assert s.skipped_steps == 5  # every overflowing step is skipped, tolerated or not


def test_max_scale_caps_growth():
    s = amp.GradScaler("cpu", init_scale=4.0, growth_interval=1, max_scale=10.0)
    assert [sc for sc, _ in _drive(s, [0, 0, 0])] == [8.0, 10.0, 10.0]


@pytest.mark.parametrize("policy", ["warn", "raise", "keep"])
def test_min_scale_floor_policies(policy):
    s = amp.GradScaler("cpu", init_scale=4.0, growth_interval=100, min_scale=1.0,
                       on_min_scale=policy)
    assert [sc for sc, _ in _drive(s, [1, 1])] == [2.0, 1.0]  # reaching the floor exactly is fine
    o = opt_with_grads([torch.tensor([INF])])
    s.scale(torch.ones(()))
    s.unscale_(o)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        if policy == "raise":
            with pytest.raises(RuntimeError, match="at its floor min_scale=1.0"):
                s.update()
        else:
            s.update()
    floor_warnings = [w for w in rec if "floor" in str(w.message)]
    assert len(floor_warnings) == (1 if policy == "warn" else 0)
    assert s.get_scale() == 1.0 and len(s._per_optimizer_states) == 0  # state stays consistent


def test_floor_check_reads_nothing_when_steps_were_clean():
    m = make_model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = amp.GradScaler("cpu", min_scale=1.0, on_min_scale="raise")
    x, y = batches(1)[0]
    s.scale(F.mse_loss(m(x), y)).backward()
    s.step(o)  # the non-fused step reads found_inf once
    reads = HostReads()
    with reads.counting():
        s.update()
    assert reads.count == 0


# ---- skipped-step visibility and host reads -----------------------------------------------------

def test_skipped_steps_visible_non_fused():
    m = make_model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = amp.GradScaler("cpu", growth_interval=2)
    seen = []
    reads = HostReads()
    for i, (x, y) in enumerate(batches(8, inf_at=(1, 5), nan_at=(6,))):
        o.zero_grad()
        s.scale(F.mse_loss(m(x), y)).backward()
        with reads.counting():
            s.step(o)
            s.update()
        seen.append(s.last_step_skipped)
    assert seen == [i in (1, 5, 6) for i in range(8)]
    assert s.skipped_steps == 3
    assert reads.count == 8  # the one read per non-fused step that decides to skip (torch: one per device)


@pytest.mark.parametrize("device", DEVICES)
def test_skipped_steps_visible_fused_without_host_reads(device):
    m = make_model().to(device)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    s = amp.GradScaler(device, growth_interval=2)
    reads = HostReads()
    skipped = []
    for i, (x, y) in enumerate(batches(6, inf_at=(2, 3))):
        x, y = x.to(device), y.to(device)
        o.zero_grad()
        s.scale(F.mse_loss(m(x), y)).backward()
        with reads.counting():
            s.step(o)
            s.update()
        skipped.append(s.last_step_skipped)  # a host read, outside the counted region
    assert reads.count == 0
    assert skipped == [False, False, True, True, False, False]
    assert s.skipped_steps == 2
    assert s.state_dict()["_skipped_steps"] == 2


# ---- fused / aware optimizers -------------------------------------------------------------------

class AwareSGD(torch.optim.SGD):
    """Records what GradScaler hands over (torch's attribute contract)."""
    _step_supports_amp_scaling = True

    def step(self, closure=None):
        self.seen = (getattr(self, "grad_scale", "absent"), getattr(self, "found_inf", "absent"))
        return "stepped"


def test_attribute_hand_off_contract():
    o = AwareSGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    o.param_groups[0]["params"][0].grad = torch.full((2,), 8.0)
    s = scaler_at(8.0)
    assert s.step(o) == "stepped"
    gs, fi = o.seen
    assert gs.item() == 8.0 and fi.item() == 0.0
    assert not hasattr(o, "grad_scale") and not hasattr(o, "found_inf")  # deleted afterwards
    assert torch.equal(o.param_groups[0]["params"][0].grad, torch.full((2,), 8.0))  # not unscaled
    s.update()
    # UNSCALED: grads already unscaled, grad_scale left as the user's (None)
    s.scale(torch.ones(()))
    s.unscale_(o)
    s.step(o)
    assert o.seen[0] is None and o.seen[1].item() == 0.0
    s.update()
    # a user-set grad_scale multiplies the scale
    s.scale(torch.ones(()))
    o.grad_scale = torch.tensor(0.5)
    s.step(o)
    assert o.seen[0].item() == s.get_scale() * 0.5
    s.update()
    # UNSCALED with a user-set grad_scale: the optimizer sees the user's value, as torch's
    s.scale(torch.ones(()))
    s.unscale_(o)
    mine = torch.tensor(2.0)
    o.grad_scale = mine
    s.step(o)
    assert o.seen[0] is mine


def test_legacy_grad_scaler_kwarg_contract():
    class Legacy(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            self.got = grad_scaler

    o = Legacy([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    o.param_groups[0]["params"][0].grad = torch.ones(2)
    s = scaler_at(2.0)
    with pytest.warns(FutureWarning, match="stop passing itself"):
        s.step(o)
    assert o.got is s


def test_peak_fused_optimizer_hand_off():
    """peak's fused optimizers take grad_scale/found_inf as step() keywords: the scaler passes
    them, the optimizer unscales and skips inside its step, and step() reads nothing."""
    po = pytest.importorskip("peak.optimizers")
    m = make_model()
    ref = make_model()
    o = po.FusedSGD(m.parameters(), lr=0.1)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    s = amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    reads = HostReads()
    poisoned = {2}  # an inf in the batch's input
    data = batches(5, inf_at=poisoned)

    def step(i, poison):
        x, y = data[i]
        o.zero_grad()
        s.scale(F.mse_loss(m(x), y)).backward()
        with reads.counting():
            s.step(o)
        s.update()

    def reference_step(i):
        x, y = data[i]
        o_ref.zero_grad()
        F.mse_loss(ref(x), y).backward()
        o_ref.step()

    assert_poisoned_steps_skipped(step, 5, poisoned, lambda: state_tensors(m, o),
                                  reference_step=reference_step)
    assert reads.count == 0 and s.skipped_steps == 1
    for a, b in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# ---- overflow attribution -----------------------------------------------------------------------

@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused_adamw"])
def test_overflow_report_names_the_parameter(fused):
    m = make_model()
    o = (torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) if fused
         else torch.optim.SGD(m.parameters(), lr=0.1))
    s = amp.GradScaler("cpu").register_model(m, prefix="net.")
    assert s.overflow_report().iteration is None
    for i, (x, y) in enumerate(batches(4)):
        o.zero_grad()
        s.scale(F.mse_loss(m(x), y)).backward()
        if i == 1:
            m[2].weight.grad[3, 3] = INF
        if i == 2:
            m[0].bias.grad[0] = NAN
        s.step(o)
        s.update()
        if i == 1:
            report = s.overflow_report()
            assert report.iteration == 1 and report.parameters == ("net.2.weight",)
    # iteration 3 was clean: the report still describes the last skipped step (iteration 2)
    report = s.overflow_report()
    assert report.iteration == 2 and report.parameters == ("net.0.bias",)
    assert "net.0.bias" in str(report) and bool(report)


def test_overflow_report_unregistered_and_off():
    m = make_model()
    extra = torch.nn.Parameter(torch.zeros(2, 2))
    o = torch.optim.SGD(list(m.parameters()) + [extra], lr=0.1)
    s = amp.GradScaler("cpu")
    with pytest.raises(RuntimeError, match="register_model"):
        s.overflow_report()
    s.register_model({"w0": m[0].weight})
    x, y = batches(1)[0]
    s.scale(F.mse_loss(m(x), y) + extra.sum()).backward()
    extra.grad[1, 0] = INF
    m[0].weight.grad[0, 0] = NAN
    s.step(o)
    s.update()
    assert s.overflow_report().parameters == (
        "w0", "<SGD param_groups[0]['params'][4], shape (2, 2)>")
    with pytest.raises(TypeError, match="register_model: model must be"):
        s.register_model(3)


def test_a_scaler_reused_across_models_keeps_no_dropped_model_alive():
    """register_model holds a module weakly (no weak reference to a tensor: swap_tensors refuses
    those) and names its parameters when a report is made: one scaler over a k-fold loop keeps no
    earlier fold's parameters, and a parameter replaced since registration is named."""
    import gc
    import weakref
    s = amp.GradScaler("cpu")
    folds = []
    for _ in range(3):
        m = make_model()
        s.register_model(m, prefix="net.")
        folds.append(weakref.ref(m[0].weight))
        del m
        gc.collect()
    assert [ref() is None for ref in folds] == [True, True, True]
    m = make_model()
    s.register_model(m, prefix="net.")
    m[2].weight = torch.nn.Parameter(m[2].weight.detach().clone())  # (after registration)
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = batches(1)[0]
    s.scale(F.mse_loss(m(x), y)).backward()
    m[2].weight.grad[0, 0] = INF
    s.step(o)
    s.update()
    assert s.overflow_report().parameters == ("net.2.weight",)


def test_overflow_report_survives_pickle_as_text():
    import pickle
    m = make_model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    s = amp.GradScaler("cpu").register_model(m)
    x, y = batches(1)[0]
    s.scale(F.mse_loss(m(x), y)).backward()
    m[0].weight.grad[0, 0] = INF
    s.step(o)
    s.update()
    s2 = pickle.loads(pickle.dumps(s))
    assert s2.overflow_report().parameters == ("0.weight",)


def test_is_a_torch_grad_scaler_with_torch_stage_enum():
    s = scaler_at(2.0)
    assert isinstance(s, torch.amp.GradScaler)
    assert OptState is torch.amp.grad_scaler.OptState
    o = opt_with_grads([torch.ones(2)])
    s.unscale_(o)
    assert s._per_optimizer_states[id(o)]["stage"] is torch.amp.grad_scaler.OptState.UNSCALED
    # every public and private method torch's class has is peak's own
    for name in dir(torch.amp.GradScaler):
        if callable(getattr(torch.amp.GradScaler, name)) and not name.startswith("__"):
            assert getattr(amp.GradScaler, name) is not getattr(torch.amp.GradScaler, name), name


# ---- the C++ gradient walk (csrc/bindings/param_grads.cpp) ---------------------------------------

def _groups(grads_per_group):
    groups = []
    for grads in grads_per_group:
        params = []
        for g in grads:
            p = torch.nn.Parameter(torch.zeros_like(g) if g is not None and g.layout == torch.strided
                                   else torch.zeros(1))
            p.grad = g
            params.append(p)
        groups.append({"params": params})
    return groups


@pytest.mark.parametrize("check_only", [False, True], ids=["unscale", "check_only"])
def test_param_grad_walk_takes_plain_grads(check_only):
    """Several groups, every kernel dtype, params without grads, transposed grads: one C++ call,
    results as torch's own unscale (fp32) or fp32 math rounded once (fp16/bf16)."""
    from peak import _C
    torch.manual_seed(0)
    grads = [[torch.randn(300) * 64, None, (torch.randn(7, 5) * 64).to(torch.float16).t()],
             [], [(torch.randn(70_000) * 64).to(torch.bfloat16), torch.randn(3, 3) * 64]]
    before = [[None if g is None else g.clone() for g in gs] for gs in grads]
    inv, found = torch.tensor(1 / 64), torch.zeros(())
    assert _C.unscale_param_grads(_groups(grads), inv, found, check_only, 65536) == 4
    assert found.item() == 0.0
    for gs, bs in zip(grads, before):
        for g, b in zip(gs, bs):
            if g is None:
                continue
            expected = b if check_only else (b.float() * inv).to(b.dtype)
            assert torch.equal(g, expected)
    grads[2][1][2, 0] = INF
    assert _C.unscale_param_grads(_groups(grads), inv, found, check_only, 65536) == 4
    assert found.item() == 1.0
    assert _C.unscale_param_grads(_groups([[None], []]), inv, torch.zeros(()), False, 65536) == 0


@pytest.mark.parametrize("odd", ["sliced", "float64", "sparse", "other_device", "subclass"])
def test_param_grad_walk_declines_before_writing(odd):
    """A gradient the kernels cannot take as it is (last, after plain ones) makes the walk return
    -1 with nothing written; GradScaler's general path then handles every gradient."""
    from torch.testing._internal.two_tensor import TwoTensor

    from peak import _C
    odd_grad = {
        "sliced": lambda: torch.full((4, 6), 8.0)[:, :3],
        "float64": lambda: torch.full((4, 3), 8.0, dtype=torch.float64),
        "sparse": lambda: torch.sparse_coo_tensor([[0, 2]], [8.0, 8.0], (4,), check_invariants=True),
        "other_device": lambda: torch.full((4,), 8.0, device="meta"),
        "subclass": lambda: TwoTensor(torch.full((4,), 8.0), torch.full((4,), 8.0)),
    }[odd]()
    plain = [torch.full((5,), 8.0), torch.full((5,), 8.0, dtype=torch.bfloat16)]
    groups = _groups([plain, []])
    p = torch.nn.Parameter(torch.zeros(odd_grad.shape, dtype=odd_grad.dtype,
                                       device=odd_grad.device))
    p.grad = odd_grad
    groups[1]["params"].append(p)
    found = torch.zeros(())
    assert _C.unscale_param_grads(groups, torch.tensor(0.125), found, False, 65536) == -1
    assert all(torch.equal(g, torch.full((5,), 8.0, dtype=g.dtype)) for g in plain)
    if odd not in ("sliced", "float64"):
        return  # their general paths are tested above (sparse; DTensor in tests/distributed)
    o = torch.optim.SGD([q for g in groups for q in g["params"]], lr=1.0)
    s = scaler_at(8.0)
    s.unscale_(o)  # the general path
    assert all(torch.equal(g, torch.ones(5, dtype=g.dtype)) for g in plain)
    assert torch.equal(odd_grad, torch.ones(odd_grad.shape, dtype=odd_grad.dtype))


def test_param_grad_walk_rejects_odd_containers():
    from peak import _C
    found = torch.zeros(())
    assert _C.unscale_param_grads(({"params": []},), torch.ones(()), found, False, 65536) == -1
    assert _C.unscale_param_grads(["x"], torch.ones(()), found, False, 65536) == -1
    assert _C.unscale_param_grads([{"params": (torch.ones(1),)}], torch.ones(()), found, False,
                                  65536) == -1
    assert _C.unscale_param_grads([{"params": [1.0]}], torch.ones(()), found, False, 65536) == -1


# ---- fused hand-off corner cases, side by side with torch ----------------------------------------

def test_fused_optimizer_without_gradients_steps_like_torch():
    """Two fused optimizers, only one with gradients this iteration: torch's found_inf for the
    other is sum([]) == 0; no error, same parameters."""
    results = []
    for cls in (torch.amp.GradScaler, amp.GradScaler):
        torch.manual_seed(0)
        a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        oa = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=True)
        ob = torch.optim.AdamW(b.parameters(), lr=1e-2, fused=True)
        s = cls("cpu", init_scale=4.0)
        s.scale(a(torch.randn(2, 3)).sum()).backward()
        s.step(oa)
        s.step(ob)
        s.update()
        results.append([p.detach().clone() for p in list(a.parameters()) + list(b.parameters())])
        assert s.get_scale() == 4.0
    assert all(torch.equal(x, y) for x, y in zip(*results))


@pytest.mark.parametrize("optimizer", ["torch_fused", "peak_fused"])
def test_torch_scaler_over_a_fused_optimizer_without_gradients(optimizer):
    """torch's scaler hands found_inf = sum([]) == 0 (an int) when no parameter has a gradient:
    the step is a no-op and update() raises torch's own error, whichever fused optimizer."""
    from peak.optimizers import FusedAdamW
    m = torch.nn.Linear(4, 3)
    o = (torch.optim.AdamW(m.parameters(), fused=True) if optimizer == "torch_fused"
         else FusedAdamW(m.parameters()))
    before = [p.detach().clone() for p in m.parameters()]
    s = torch.amp.GradScaler("cpu")
    s.scale(torch.tensor(1.0, requires_grad=True) * 2)
    s.step(o)
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        s.update()


@pytest.mark.parametrize("cls", [torch.amp.GradScaler, amp.GradScaler])
def test_an_expanded_gradient_is_refused_before_a_fused_step(cls):
    """A gradient whose elements share memory (``expand``): torch's fused steps unscale it in
    place and write out of bounds; both scalers refuse it with torch's message, weights and
    scale untouched."""
    w = torch.nn.Parameter(torch.ones(6, 5))
    o = torch.optim.SGD([w], lr=1.0, fused=True)
    s = cls("cpu", init_scale=256.0)
    s.scale(torch.tensor(1.0))
    w.grad = torch.tensor([256.0]).expand(6, 5)
    with pytest.raises(RuntimeError, match="single memory location"):
        s.step(o)
    assert torch.equal(w.detach(), torch.ones(6, 5)) and s.get_scale() == 256.0
    w.grad = w.grad.clone()
    s.step(o)
    s.update()
    assert torch.equal(w.detach(), torch.zeros(6, 5))
    if cls is amp.GradScaler:  # (unscale_ refuses before it unscales any gradient; torch's
        v = torch.nn.Parameter(torch.ones(3))  # unscales those before the expanded one)
        v.grad, w.grad = torch.full((3,), 8.0), torch.tensor([8.0]).expand(6, 5)
        s.scale(torch.tensor(1.0))
        with pytest.raises(RuntimeError, match="single memory location"):
            s.unscale_(torch.optim.SGD([v, w], lr=1.0))
        assert torch.equal(v.grad, torch.full((3,), 8.0))


def test_subclass_overriding_unscale_grads_keeps_torchs_contract():
    """A subclass overriding _unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16) (as
    FSDP's ShardedGradScaler does) also serves the fused path."""
    calls = []

    class Sub(amp.GradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            calls.append(allow_fp16)
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    m = torch.nn.Linear(3, 3)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    s = Sub("cpu", init_scale=4.0)
    s.scale(m(torch.randn(2, 3)).sum()).backward()
    s.step(o)
    s.update()
    assert calls == [True]


def test_fused_hand_off_gives_fresh_tensors():
    """An optimizer writing to the grad_scale/found_inf it is handed must not change the
    scaler's own state (torch hands over new tensors too)."""
    class Rude(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None):
            self.found_inf.zero_()
            self.grad_scale.fill_(1.0)

    for cls in (torch.amp.GradScaler, amp.GradScaler):
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = torch.tensor([float("inf"), 1.0])
        s = cls("cpu", init_scale=1024.0)
        s.scale(torch.ones(()))
        s.step(Rude([p], lr=1.0))
        s.update()
        assert s.get_scale() == 512.0, cls


def test_sparse_gradients_that_share_values_are_unscaled_once():
    """Two embeddings' sparse gradients from one sum may share their values' memory: unscale_
    unscales each once (a copy), as the unscaled backward's gradients."""
    torch.manual_seed(0)
    tok, pos = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Embedding(8, 4, sparse=True)
    lin = torch.nn.Linear(4, 1)
    ref = copy.deepcopy([tok, pos, lin])
    opt = torch.optim.SGD([*tok.parameters(), *pos.parameters()], lr=0.1)
    s = amp.GradScaler("cpu", init_scale=1024.0)
    idx, at = torch.tensor([1, 2, 3, 2]), torch.arange(4)
    s.scale(lin(tok(idx) + pos(at)).sum()).backward()
    s.unscale_(opt)
    ref[2](ref[0](idx) + ref[1](at)).sum().backward()
    for m, r in zip((tok, pos), ref):
        assert torch.equal(m.weight.grad.to_dense(), r.weight.grad.to_dense())


@pytest.mark.parametrize("setter, value, exc", [
    ("set_growth_interval", 0, ValueError), ("set_growth_interval", 2**32 + 1, ValueError),
    ("set_growth_factor", 0.5, AssertionError), ("set_growth_factor", float("nan"), AssertionError),
    ("set_backoff_factor", 2.0, AssertionError)])
def test_setters_refuse_what_the_constructor_refuses_and_change_nothing(setter, value, exc):
    """torch's setters take any value and its update misbehaves later; peak's update raised after
    the step had run, which left the iteration unfinishable. Refused at the setter, the scaler
    trains on as torch's scaler does."""
    runs = []
    for scaler in (amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")):
        p = torch.nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([p], lr=0.1)
        if isinstance(scaler, amp.GradScaler):
            with pytest.raises(exc):
                getattr(scaler, setter)(value)
        for _ in range(3):
            scaler.scale(p.sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs.append((p.detach().clone(), scaler.get_scale(), scaler.get_growth_factor(),
                     scaler.get_backoff_factor(), scaler.get_growth_interval()))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1:] == runs[1][1:]


def test_a_setter_checks_its_own_value_alone():
    """A valid value is taken whatever else the scaler holds (a loaded torch state above this
    scaler's max_scale, documented as allowed; an unpickled scaler whose scale was set below
    min_scale): the setter refused it over the unrelated option. No value: torch's TypeError."""
    import pickle
    scaler = amp.GradScaler("cpu", max_scale=2.0**16)
    scaler.load_state_dict(torch.amp.GradScaler("cpu", init_scale=2.0**17).state_dict())
    scaler.set_growth_interval(100)
    assert scaler.get_growth_interval() == 100
    scaler = amp.GradScaler("cpu", init_scale=1024.0, min_scale=64.0)
    p = torch.nn.Parameter(torch.ones(3))
    scaler.scale(p.sum()).backward()
    scaler.step(torch.optim.SGD([p], lr=0.1))
    scaler.update(new_scale=8.0)
    copy_ = pickle.loads(pickle.dumps(scaler))
    copy_.set_growth_factor(4.0)
    assert copy_.get_growth_factor() == 4.0
    with pytest.raises(TypeError, match="new_factor"):
        amp.GradScaler("cpu").set_growth_factor()


def test_torch_fused_sgd_whose_first_step_overflows():
    """torch's SGD(fused=True) makes its momentum buffers (empty_like) in its first step, which a
    skip on the device leaves uninitialised (torch's own GradScaler then trains on garbage): until
    they exist the skip is decided on the host, then on the device again. With a power-of-two
    scale the run equals one that never took the overflowing step, bit for bit."""
    def run(skip_first):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
        scaler = amp.GradScaler("cpu")
        junk = [torch.full((64, 64), 1e30) for _ in range(16)]  # freed memory empty_like may take
        del junk
        reads = HostReads()
        for step in range(3 if skip_first else 2):
            x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step - skip_first))
            loss = model(x).pow(2).mean() * (float("inf") if skip_first and step == 0 else 1.0)
            opt.zero_grad()
            scaler.scale(loss).backward()
            with reads.counting():
                scaler.step(opt)
            scaler.update()
        return model.state_dict(), opt.state_dict()["state"], reads.count, scaler

    (weights, state, reads, scaler), (ref_weights, ref_state, _, _) = run(True), run(False)
    assert scaler.skipped_steps == 1
    for name in weights:
        assert torch.equal(weights[name], ref_weights[name]), name
    for i in state:
        assert torch.equal(state[i]["momentum_buffer"], ref_state[i]["momentum_buffer"])
    assert reads == 2  # the skip and the step that made the buffers; then on the device


def test_torch_fused_sgd_first_steps_are_torchs_calls_and_bits():
    """Until its momentum buffers exist, torch's fused SGD still gets grad_scale/found_inf, as
    from torch's scaler: the same bits with a scale that is not a power of two (an unscale in
    place rounds otherwise), and step() called on a skipped first step too (its hooks run, an LR
    scheduler sees a step), which leaves no buffer behind (torch's leaves garbage buffers); a
    parameter's other state is kept, and a loaded ``momentum_buffer: None`` counts as none."""
    def run(mod, overflow_first):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
        calls = []
        opt.register_step_pre_hook(lambda *_: calls.append(1))
        if overflow_first:  # (as torch's older SGD saved, and a key of a subclass's own)
            opt.load_state_dict({"state": {0: {"momentum_buffer": None, "mine": 1}},
                                 "param_groups": opt.state_dict()["param_groups"]})
        scaler = mod.GradScaler("cpu", init_scale=3.0, growth_factor=1.7, backoff_factor=0.3,
                                growth_interval=1)
        states = []
        for step in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
            loss = model(x).pow(2).mean() * (float("inf") if overflow_first and not step else 1.)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            states.append(copy.deepcopy(opt.state_dict()["state"]))
        return model.state_dict(), states, len(calls), scaler.get_scale()

    (weights, states, _, scale), (ref_weights, ref_states, _, ref_scale) = (
        run(amp, False), run(torch.amp, False))
    assert scale == ref_scale
    for name in weights:
        assert torch.equal(weights[name], ref_weights[name]), name
    for state, ref in zip(states, ref_states):
        assert state.keys() == ref.keys()
        for i in state:
            assert torch.equal(state[i]["momentum_buffer"], ref[i]["momentum_buffer"])
    weights, states, calls, _ = run(amp, True)
    assert states[0] == {0: {"mine": 1}, 1: {}} and calls == run(torch.amp, True)[2] == 3
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_a_state_dict_with_one_element_tensors_loads_as_torchs_does():
    """torch's load_state_dict fills its tensors from what the dict holds, so a converted or
    hand-made dict with tensor entries loads there: it loads here too, to the same state."""
    plain = {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 5,
             "_growth_tracker": 3}
    tensors = {**plain, "scale": torch.tensor(8), "growth_factor": torch.tensor(2.0),
               "_growth_tracker": torch.tensor(3, dtype=torch.int32)}
    theirs = torch.amp.GradScaler("cpu")
    theirs.load_state_dict(tensors)
    for state in (plain, tensors):
        ours = amp.GradScaler("cpu")
        ours.load_state_dict(state)
        assert ours.state_dict()["_growth_tracker"] == theirs.state_dict()["_growth_tracker"] == 3
        assert ours.get_scale() == theirs.get_scale() == 8.0
    for bad in (torch.tensor(3.5), torch.tensor(True)):  # (an int of a float or bool: refused)
        with pytest.raises(TypeError, match="_growth_tracker must be an int, got Tensor"):
            amp.GradScaler("cpu").load_state_dict({**plain, "_growth_tracker": bad})
