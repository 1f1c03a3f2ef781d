"""Loss-scale collapse: gradients that overflow every step drive the scale down to its floor
(GradScaler's ``min_scale``, amp's ``min_loss_scale``) and keep every step skipped; at the floor,
GradScaler's ``on_min_scale`` policy warns / raises / keeps quiet as documented, and the message
names the parameters that keep overflowing (from ``register_model``)."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch

from peak import amp

INIT, FLOOR = 2.0 ** 8, 1.0
TO_FLOOR = 8  # 2**8 halved 8 times is 1.0: reaching the floor exactly is not yet a hit


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(OrderedDict(fc1=torch.nn.Linear(8, 16), act=torch.nn.ReLU(),
                                           fc2=torch.nn.Linear(16, 4)))


def _step(model, opt, scaler, poison=True):
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    opt.zero_grad()
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    if poison:
        model.fc2.weight.grad[0, 0] = float("inf")  # the parameter that keeps overflowing
    scaler.step(opt)
    scaler.update()


def _run(policy, iterations, register=True):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = amp.GradScaler("cpu", init_scale=INIT, min_scale=FLOOR, on_min_scale=policy)
    if register:
        scaler.register_model(model)
    before = [p.detach().clone() for p in model.parameters()]
    scales, messages, raised = [], [], []
    for i in range(iterations):
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            try:
                _step(model, opt, scaler)
            except RuntimeError as e:
                raised.append((i, str(e)))
        messages += [(i, str(w.message)) for w in rec if issubclass(w.category, RuntimeWarning)]
        scales.append(scaler.get_scale())
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return scaler, scales, messages, raised, unchanged, model, opt


def _expected_scales(n):
    return [max(INIT * 0.5 ** (i + 1), FLOOR) for i in range(n)]


@pytest.mark.parametrize("policy", ["warn", "raise", "keep"])
def test_persistent_overflow_drives_scale_to_the_floor(policy):
    n = TO_FLOOR + 4
    scaler, scales, messages, raised, unchanged, _, _ = _run(policy, n)
    assert scales == _expected_scales(n)
    assert scales[-1] == FLOOR
    assert unchanged  # every step skipped, the weights never moved
    assert scaler.skipped_steps == n
    hits = list(range(TO_FLOOR, n))  # iterations that overflow while already at the floor
    if policy == "warn":
        assert [i for i, _ in messages] == hits and raised == []
    elif policy == "raise":
        assert [i for i, _ in raised] == hits and messages == []
    else:
        assert messages == [] and raised == []
    for i, msg in messages + raised:
        assert f"min_scale={FLOOR}" in msg
        assert f"fc2.weight (in {i + 1} skipped iterations)" in msg  # named, with its count
        assert "fc1" not in msg  # only the parameter that overflowed


def test_raise_leaves_a_consistent_scaler_that_recovers():
    scaler, scales, _, raised, _, model, opt = _run("raise", TO_FLOOR + 1)
    assert len(raised) == 1 and scales[-1] == FLOOR
    scaler.set_growth_interval(2)
    for _ in range(4):  # the overflow stops: steps are taken and the scale grows again
        before = [p.detach().clone() for p in model.parameters()]
        _step(model, opt, scaler, poison=False)
        assert not scaler.last_step_skipped
        assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.get_scale() == 4 * FLOOR


def test_without_register_model_the_message_says_how_to_get_names():
    _, _, messages, _, _, _, _ = _run("warn", TO_FLOOR + 1, register=False)
    assert len(messages) == 1 and "register_model" in messages[0][1] and "fc2" not in messages[0][1]


def test_report_names_the_overflowing_parameter():
    scaler, *_ = _run("keep", 3)
    report = scaler.overflow_report()
    assert report.parameters == ("fc2.weight",) and report.iteration == 2


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_amp_min_loss_scale_floor(low):
    """The Apex dialect: persistent overflow halves the scale down to min_loss_scale and no
    further; every step is skipped and master weights and model weights stay put."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=low, loss_scale="dynamic",
                                min_loss_scale=64.0, verbosity=0)
    before = [p.detach().clone() for p in model.parameters()] + [p.detach().clone() for p in amp.master_params(opt)]
    scales = []
    for _ in range(14):
        loss = torch.nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4)) * float("inf")
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        scales.append(amp._amp_state.loss_scalers[0].loss_scale())
    assert scales == [max(65536.0 * 0.5 ** (i + 1), 64.0) for i in range(14)]
    after = [p.detach() for p in model.parameters()] + [p.detach() for p in amp.master_params(opt)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("dialect", ["apex", "torch"])
def test_without_a_floor_the_scale_stops_above_zero_and_the_next_clean_step_trains(dialect):
    """No min_scale / min_loss_scale: 160 overflowing iterations in a row would take a scale of
    2^16 to 0 in fp32 (torch's GradScaler gets there), and the next clean loss times 0 passes the
    inf/NaN check and unscales to NaN weights. peak's scale stops at 2^-126 (NOTE: [The scale
    never reaches zero]): the clean step after it is a finite step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if dialect == "apex":
        model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=torch.bfloat16,
                                    loss_scale="dynamic", verbosity=0)
        scale_of = lambda: amp._amp_state.loss_scalers[0].loss_scale()  # noqa: E731
    else:
        scaler = amp.GradScaler("cpu")
        scale_of = scaler.get_scale

    def iteration(poison):
        loss = torch.nn.functional.mse_loss(model(torch.randn(4, 8)).float(), torch.randn(4, 4))
        loss = loss * float("nan") if poison else loss
        if dialect == "apex":
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()

    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(160):
        iteration(poison=True)
    assert scale_of() == torch.finfo(torch.float32).tiny
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    iteration(poison=False)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
