"""The paths trainers and users really take (issue 14): closure steps, several losses with fused
optimizers, optimizer wrappers, gradients after a fused step, amp.master_params under fused O2,
training that bypasses amp, Apex's keywords, unskipped counts, exact state_dict round trips.
Every test compares against an independent run (the documented path, or torch's own) and fails
on the behaviour the issue describes."""
import contextlib
import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_helpers import DTYPES, make_mlp
from peak import amp
from peak.optimizers import (FusedAdagrad, FusedAdam, FusedAdamW, FusedLAMB,
                             FusedMixedPrecisionLamb, FusedNovoGrad, FusedSGD)

FUSED = {"FusedSGD": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9),
         "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2),
         "FusedAdamW": lambda ps: FusedAdamW(ps, lr=1e-2),
         "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-2),
         "FusedMixedPrecisionLamb": lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2),
         "FusedAdagrad": lambda ps: FusedAdagrad(ps, lr=1e-2),
         "FusedNovoGrad": lambda ps: FusedNovoGrad(ps, lr=1e-2)}
TORCH = {"SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
         "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-2)}


def data(step, n=16):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, 6, generator=g)
    return x, x[:, :3].argmax(dim=1)


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def _assert_bitwise(a, b):
    """Same dtype and values, bit for bit (NaN where the other has NaN: O3 Adam on fp16 weights)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)


# ---- 1. closures ----------------------------------------------------------------------------
def _train(level, dtype, make_opt, use_closure, steps=4):
    model = make_mlp()
    opt = make_opt(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=level, low_precision_dtype=dtype, verbosity=0)
    losses = _amp_steps(model, opt, steps, use_closure)
    return _weights(model), torch.stack([loss.detach() for loss in losses])


def _amp_steps(model, opt, steps, use_closure):
    """Training steps with scale_loss inside a closure, passed to step() (as Lightning does) or
    called first; returns the losses."""
    losses = []
    for i in range(steps):
        x, y = data(i)

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(x).float(), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            return loss

        if use_closure:
            losses.append(opt.step(closure))
        else:
            losses.append(closure())
            opt.step()
    return losses


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("name", list(FUSED) + list(TORCH))
def test_closure_step_equals_closure_then_step(name, level, dtype):
    """Lightning's `optimizer.step(closure)` with scale_loss inside the closure: the step must use
    the closure's gradients, unscaled (FusedSGD moved the weights by the scaled gradient)."""
    make = {**FUSED, **TORCH}[name]
    w_closure, l_closure = _train(level, dtype, make, use_closure=True)
    amp._amp_state.reset()
    w_plain, l_plain = _train(level, dtype, make, use_closure=False)
    _assert_bitwise(w_closure, w_plain)
    torch.testing.assert_close(l_closure, l_plain, rtol=0, atol=0, equal_nan=True)


def test_closure_issue_reproducer_weight_change_is_small():
    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    m = nn.Linear(8, 4)
    o = FusedSGD(m.parameters(), lr=.1)
    m, o = amp.initialize(m, o, opt_level="O2", verbosity=0)
    w0 = m.weight.detach().float().clone()

    def closure():
        o.zero_grad()
        loss = F.cross_entropy(m(x), y)
        with amp.scale_loss(loss, o) as s:
            s.backward()
        return loss

    o.step(closure)
    # the true step: lr * ||grad|| of a cross-entropy over 4 classes (< 1 per element)
    assert (m.weight.float() - w0).norm().item() < 1.0


def test_lbfgs_closure_without_master_weights_still_runs():
    model = make_mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    model, opt = amp.initialize(model, opt, opt_level="O1", low_precision_dtype=torch.bfloat16,
                                verbosity=0)
    x, y = data(0)
    calls = []

    def closure():
        opt.zero_grad()
        out = model(x)
        calls.append(out.dtype)  # O1's casts are on in the closure LBFGS calls inside step()
        loss = F.cross_entropy(out.float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        return loss

    before = _weights(model)
    opt.step(closure)
    assert len(calls) > 1 and set(calls) == {torch.bfloat16}  # LBFGS evaluated it itself, cast
    assert any(not torch.equal(a, b) for a, b in zip(before, _weights(model)))
    assert model(x).dtype == torch.bfloat16  # the step's own casts-off region is over


def test_lbfgs_with_master_weights_is_refused():
    model = make_mlp()
    opt = torch.optim.LBFGS(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with pytest.raises(RuntimeError, match=r"without master weights \(O0, O1, O3\)"):
        opt.step(lambda: torch.zeros(()))


def test_lbfgs_with_a_dynamic_scale_is_refused_before_it_steps_on_an_overflow():
    """LBFGS evaluates its closure inside step() and steps on what it gets: an overflow of the
    dynamic scale's first steps (an fp16 O1 default) wrote NaN into the weights. Refused before
    the closure runs; with a static scale the same run trains."""
    x, y = torch.randn(16, 16, generator=torch.Generator().manual_seed(0)), None
    for loss_scale in ("dynamic", 128.0):
        amp._amp_state.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
        model, opt = amp.initialize(model, opt, opt_level="O1", loss_scale=loss_scale,
                                    low_precision_dtype=torch.float16, verbosity=0)
        y = 30 * torch.randn(16, 8, generator=torch.Generator().manual_seed(1))

        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(x).float(), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            return loss

        before = _weights(model)
        if loss_scale == "dynamic":
            with pytest.raises(RuntimeError, match=r"static loss scale \(amp.initialize\(\.\.\., "
                                                   r"loss_scale=128.0\)"):
                opt.step(closure)
            _assert_bitwise(_weights(model), before)
        else:
            opt.step(closure)
            after = _weights(model)
            assert all(torch.isfinite(w).all() for w in after)
            assert any(not torch.equal(a, b) for a, b in zip(after, before))


# ---- 2. several losses, fused ---------------------------------------------------------------
@pytest.mark.parametrize("name", ["FusedSGD", "FusedAdam", "SGD"])
def test_overflow_charged_to_its_own_loss_only(name):
    make = {**FUSED, **TORCH}[name]
    a, b = make_mlp(1), make_mlp(2)
    oa, ob = make(a.parameters()), make(b.parameters())
    [a, b], [oa, ob] = amp.initialize([a, b], [oa, ob], opt_level="O2", num_losses=2,
                                      max_loss_scale=4.0, verbosity=0)
    x, y = data(0)
    loss_a = F.cross_entropy(a(x).float(), y)
    with amp.scale_loss(loss_a, oa, loss_id=0) as s:
        s.backward()
        a[0].weight.grad = torch.full_like(a[0].weight, float("inf"))  # inside loss 0's block
    loss_b = F.cross_entropy(b(x).float(), y)
    with amp.scale_loss(loss_b, [oa, ob], loss_id=1) as s:
        s.backward()
    scales = [amp._amp_state.loss_scalers[i].loss_scale() for i in range(2)]
    assert scales == [2.0, 4.0]
    wa, wb = _weights(a), _weights(b)
    oa.step()
    ob.step()
    _assert_bitwise(_weights(a), wa)  # skipped
    assert any(not torch.equal(p, q) for p, q in zip(_weights(b), wb))  # stepped


@pytest.mark.parametrize("name", ["FusedSGD", "FusedAdam"])
def test_a_stepped_optimizers_old_gradients_are_not_charged_to_a_later_loss(name):
    """Two models, each stepped after its own loss, the first optimizer passed to the second
    loss too (Lightning's manual_backward passes every optimizer); loss 0 overflows once. With a
    fused optimizer the skipped step's inf gradients stayed and were charged to loss 1 (its clean
    step skipped, its scale halved) and to the first optimizer's next clean step: a step's (or
    skip's) gradients go before the next backward, as a torch optimizer's masters' do. The runs
    equal the torch optimizer's, bit for bit, over steps without zero_grad too."""
    def run(make):
        amp._amp_state.reset()
        a, b = make_mlp(1), make_mlp(2)
        oa, ob = make(a.parameters()), make(b.parameters())
        [a, b], [oa, ob] = amp.initialize([a, b], [oa, ob], opt_level="O2", num_losses=2,
                                          verbosity=0)
        scales = []
        for i in range(4):
            x, y = data(i)
            if i != 3:  # (the last: no zero_grad, a step's gradients go all the same)
                oa.zero_grad()
            loss_a = F.cross_entropy(a(x).float(), y) * (float("inf") if i == 1 else 1.0)
            with amp.scale_loss(loss_a, oa, loss_id=0) as s:
                s.backward()
            oa.step()
            if i != 3:
                ob.zero_grad()
            with amp.scale_loss(F.cross_entropy(b(x).float(), y), [oa, ob], loss_id=1) as s:
                s.backward()
            ob.step()
            scales.append([amp._amp_state.loss_scalers[k].loss_scale() for k in range(2)])
        return scales, _weights(a) + _weights(b)
    theirs = run(lambda ps: {"FusedSGD": TORCH["SGD"], "FusedAdam": TORCH["Adam"]}[name](ps))
    ours = run(FUSED[name])
    assert ours[0] == theirs[0] and ours[0][-1] == [2.0**15, 2.0**16]
    _assert_bitwise(ours[1], theirs[1])


@pytest.mark.parametrize("zero", ["none", "model set_to_none=False"])
def test_a_steps_gradients_go_unless_zeroed_with_fp32_params_too(zero):
    """O2 with fp32 parameters (BatchNorm: their own masters): without zero_grad, a skipped
    step's inf gradients of those were added into the next step, whose check saw only the new
    ones (torch optimizer: the BatchNorm weights went NaN); with ``model.zero_grad(set_to_none=
    False)`` a parameter the next backward does not reach keeps its zero gradient and is stepped
    (momentum), as in fp32 and Apex (the fused path's first drop undid the zeros; amp's store
    for a torch optimizer gave such a master no gradient). The two agree bit for bit."""
    def run(make):
        amp._amp_state.reset()
        torch.manual_seed(0)
        model = nn.ModuleDict({"a": nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8)),
                               "b": nn.Linear(6, 8)})
        model, opt = amp.initialize(model, make(model.parameters()), opt_level="O2",
                                    verbosity=0)
        moved = []
        for i in range(5):
            if zero != "none":
                model.zero_grad(set_to_none=False)
            x = torch.randn(16, 6, generator=torch.Generator().manual_seed(i)).half()
            out = model["a"](x) + (model["b"](x) if i % 2 == 0 else 0)
            loss = out.float().pow(2).mean() * (float("inf") if i == 1 else 1.0)
            before = model["b"].weight.detach().clone()
            with amp.scale_loss(loss, opt) as s:
                s.backward()
            opt.step()
            moved.append(not torch.equal(before, model["b"].weight))
        return moved, _weights(model)
    ours, theirs = run(FUSED["FusedSGD"]), run(TORCH["SGD"])
    assert all(torch.isfinite(w).all() for w in theirs[1])
    _assert_bitwise(ours[1], theirs[1])
    # (step 1 skipped; b, unreached at step 3, steps on its momentum where its gradient was zeroed)
    assert ours[0] == theirs[0] == [True, False, True, zero != "none", True]


def test_fused_overflow_in_second_loss_is_still_caught():
    """Setting earlier gradients aside must not hide an overflow of the new pass."""
    a = make_mlp(1)
    oa = FusedAdam(a.parameters(), lr=1e-2)
    a, oa = amp.initialize(a, oa, opt_level="O2", num_losses=2, max_loss_scale=4.0, verbosity=0)
    x, y = data(0)
    with amp.scale_loss(F.cross_entropy(a(x).float(), y), oa, loss_id=0) as s:
        s.backward()
        a[0].weight.grad = torch.full_like(a[0].weight, float("nan"))
    with amp.scale_loss(F.cross_entropy(a(x).float(), y), oa, loss_id=1) as s:
        s.backward()
        a[2].bias.grad = torch.full_like(a[2].bias, float("inf"))
    assert [amp._amp_state.loss_scalers[i].loss_scale() for i in range(2)] == [2.0, 2.0]


def test_fused_accumulation_over_two_losses_matches_one_pass():
    """Two clean losses accumulate like one backward of their sum (scales equal, same bits)."""
    def run(split):
        model = make_mlp()
        opt = FusedSGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O2", num_losses=2, verbosity=0)
        x, y = data(0)
        if split:
            for i, (lo, hi) in enumerate([(0, 8), (8, 16)]):
                loss = F.cross_entropy(model(x[lo:hi]).float(), y[lo:hi], reduction="sum")
                with amp.scale_loss(loss, opt, loss_id=i) as s:
                    s.backward()
        else:
            out = model(x).float()
            loss0 = F.cross_entropy(out[:8], y[:8], reduction="sum")
            loss1 = F.cross_entropy(out[8:], y[8:], reduction="sum")
            with amp.scale_loss(loss0, opt, loss_id=0) as s:
                s.backward(retain_graph=True)
            with amp.scale_loss(loss1, opt, loss_id=1) as s:
                s.backward()
        opt.step()
        return [p.grad.clone() for p in model.parameters()], _weights(model)

    g1, w1 = run(True)
    amp._amp_state.reset()
    g2, w2 = run(False)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-3, atol=1e-3)


# ---- 5. optimizer wrappers ------------------------------------------------------------------
class _Forwarding:
    """What both stand-ins share: everything goes to the inner optimizer, kept under ``_INNER``."""
    _INNER = "optimizer"

    @property
    def _inner(self):
        return getattr(self, self._INNER)

    @property
    def param_groups(self):
        return self._inner.param_groups

    @property
    def state(self):
        return self._inner.state

    def zero_grad(self, set_to_none=True):
        self._inner.zero_grad(set_to_none)

    def step(self, closure=None):
        return self._inner.step(closure)

    def state_dict(self):
        return self._inner.state_dict()

    def load_state_dict(self, sd):
        self._inner.load_state_dict(sd)


class AcceleratedLikeOptimizer(_Forwarding, torch.optim.Optimizer):
    """Like accelerate.optimizer.AcceleratedOptimizer: an Optimizer subclass that does not run
    Optimizer.__init__, keeps the optimizer in .optimizer and forwards to it."""

    def __init__(self, optimizer):  # noqa: D107 (no super().__init__, as Accelerate)
        self.optimizer = optimizer

    @property
    def defaults(self):
        return self.optimizer.defaults


class LarcLike(_Forwarding):
    """Like Apex's LARC: a plain object keeping the optimizer in .optim."""
    _INNER = "optim"

    def __init__(self, optimizer):
        self.optim = optimizer


@pytest.mark.parametrize("wrap", [AcceleratedLikeOptimizer, LarcLike], ids=["accelerate", "larc"])
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("name", ["SGD", "FusedAdam"])
def test_wrapped_optimizer_trains_like_the_inner_one(wrap, level, name):
    make = {**FUSED, **TORCH}[name]

    def run(wrapped, use_closure):
        model = make_mlp()
        opt = make(model.parameters())
        if wrapped:
            opt = wrap(opt)
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
        _amp_steps(model, opt, 3, use_closure)
        clip = list(amp.master_params(opt))
        return _weights(model), opt.state_dict(), [p.dtype for p in clip]

    w_ref, sd_ref, dt_ref = run(False, False)
    for use_closure in (False, True):
        amp._amp_state.reset()
        w, sd, dt = run(True, use_closure)
        _assert_bitwise(w, w_ref)
        assert dt == dt_ref
        # (wrapped, a fused optimizer steps amp's masters from param_groups: both save them in
        # the one layout, state[i]["master_param"])
        assert sd.keys() == sd_ref.keys()


@pytest.mark.parametrize("wrap", [AcceleratedLikeOptimizer, LarcLike], ids=["accelerate", "larc"])
@pytest.mark.parametrize("name", ["SGD", "FusedAdam", "FusedSGD"])
@pytest.mark.parametrize("optimizer_first", [False, True], ids=["model first", "optimizer first"])
def test_wrapped_optimizer_resumes_bit_for_bit_under_o2(wrap, name, optimizer_first):
    """A fused optimizer in a wrapper steps amp's masters (the store's, in its groups): its own
    load stripped their saved values before the store's hook saw them, so a resume restarted
    from the fp16 weights (masters up to 1e-4 off, silently)."""
    make = {**FUSED, **TORCH}[name]

    def fresh():
        model = make_mlp()
        return amp.initialize(model, wrap(make(model.parameters())), opt_level="O2",
                              verbosity=0)

    model, opt = fresh()
    _amp_steps(model, opt, 3, False)
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                           "amp": amp.state_dict()})
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    _amp_steps(model, opt, 3, False)
    expected = _weights(model)
    model, opt = fresh()
    loads = [lambda: model.load_state_dict(saved["model"]),
             lambda: opt.load_state_dict(saved["optimizer"])]
    for load in reversed(loads) if optimizer_first else loads:
        load()
    amp.load_state_dict(saved["amp"])
    _assert_bitwise([m.detach() for m in amp.master_params(opt)], masters)
    _amp_steps(model, opt, 3, False)
    _assert_bitwise(_weights(model), expected)


@pytest.mark.parametrize("name", ["SGD", "FusedSGD", "FusedAdagrad", "FusedAdam"])
def test_larc_sees_unscaled_gradients_under_o2(name):
    """LARC's trust ratio ||w|| / ||g|| reads the gradients before the inner step: under O2 they
    must be the unscaled fp32 master gradients (as Apex), also around a peak fused optimizer."""
    from peak.optimizers import LARC

    make = {**FUSED, **TORCH}[name]
    torch.manual_seed(0)
    base = nn.Linear(16, 4)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    ref = copy.deepcopy(base)
    ref_opt = LARC(make(ref.parameters()))
    for _ in range(3):
        ref_opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
    model = copy.deepcopy(base)
    opt = LARC(make(model.parameters()))
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=1024.0, verbosity=0)
    for _ in range(3):
        opt.zero_grad()
        with amp.scale_loss(((model(x).float() - y) ** 2).mean(), opt) as s:
            s.backward()
        opt.step()
    for a, b in zip(amp.master_params(opt), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)  # fp16 forward vs fp32


class _LookaheadBase(torch.optim.Optimizer):
    """Lookahead (k steps forward, one back): every k-th step the slow weights move alpha toward
    the fast ones, which then take them; written in the wrapper's step after the inner step."""

    def __init__(self, inner, k=2, alpha=0.5):  # noqa: D107 (no super().__init__: a wrapper)
        setattr(self, self.INNER, inner)
        self.k, self.alpha, self.count, self.slow = k, alpha, 0, {}
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}

    param_groups = property(lambda self: getattr(self, self.INNER).param_groups)
    defaults = property(lambda self: getattr(self, self.INNER).defaults)
    state = property(lambda self: getattr(self, self.INNER).state)

    def zero_grad(self, set_to_none=True):
        getattr(self, self.INNER).zero_grad(set_to_none)

    def step(self, closure=None):
        loss = getattr(self, self.INNER).step(closure)
        self.count += 1
        if self.count % self.k == 0:
            for group in self.param_groups:
                for p in group["params"]:
                    self.sync(p, self.slow.setdefault(p, p.detach().clone()))
        return loss


class TimmLikeLookahead(_LookaheadBase):
    """timm's shape: the optimizer in .base_optimizer, weights without a gradient left alone,
    written through .data (which no version counter sees)."""
    INNER = "base_optimizer"

    def sync(self, p, slow):
        if p.grad is not None:
            slow.add_(p.data - slow, alpha=self.alpha)
            p.data.copy_(slow)


class PlainLookahead(_LookaheadBase):
    """The optimizer in .optimizer; every weight synced in place under no_grad."""
    INNER = "optimizer"

    @torch.no_grad()
    def sync(self, p, slow):
        slow.add_(p - slow, alpha=self.alpha)
        p.copy_(slow)


@pytest.mark.parametrize("wrap", [TimmLikeLookahead, PlainLookahead], ids=["timm", "plain"])
@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_lookahead_under_o2_syncs_the_masters_and_the_model_follows(wrap, name):
    """What a wrapper writes after the inner step (Lookahead's sync of the fp32 masters, reading
    their gradients) reaches the model before the next forward: bit for bit the hand-written O2
    loop (fp32 masters in the same wrapper, an fp16 copy of the model). Before, the sync of
    .data wrappers saw no gradients (dropped by the inner step) and the model kept the unsynced
    weights until the next step's copy; timm's attribute name was refused."""
    torch.manual_seed(0)
    base = make_mlp()
    ref16, masters = copy.deepcopy(base).half(), copy.deepcopy(base)
    ref_opt = wrap(TORCH[name](masters.parameters()))
    model = copy.deepcopy(base)
    model, opt = amp.initialize(model, wrap(TORCH[name](model.parameters())), opt_level="O2",
                                loss_scale=128.0, verbosity=0)
    for i in range(5):
        x, y = data(i)
        ref_opt.zero_grad()
        for p in ref16.parameters():
            p.grad = None
        (F.cross_entropy(ref16(x.half()).float(), y) * 128.0).backward()
        for p16, m in zip(ref16.parameters(), masters.parameters()):
            m.grad = p16.grad.float() * (1.0 / 128.0)
        ref_opt.step()
        with torch.no_grad():
            for p16, m in zip(ref16.parameters(), masters.parameters()):
                p16.copy_(m)
        opt.zero_grad()
        with amp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
        _assert_bitwise(_weights(model), _weights(ref16))
        _assert_bitwise([m.detach() for m in amp.master_params(opt)], _weights(masters))
    assert opt.count == 5 and len(opt.slow) == len(list(masters.parameters()))


def test_lookahead_work_on_a_skipped_step_reaches_the_model():
    """On a skipped step the inner step is skipped but the wrapper's own work runs (the second
    sync here): what it writes into the masters reaches the model, and the skip changed nothing
    else (the masters equal the sync of unchanged weights)."""
    torch.manual_seed(0)
    model = make_mlp()
    model, opt = amp.initialize(model, PlainLookahead(TORCH["SGD"](model.parameters()), k=2),
                                opt_level="O2", verbosity=0)
    for i in range(4):
        x, y = data(i)
        opt.zero_grad()
        before = [m.detach().clone() for m in amp.master_params(opt)]
        with amp.scale_loss(F.cross_entropy(model(x), y) * (float("inf") if i == 3 else 1.0),
                            opt) as scaled:
            scaled.backward()
        opt.step()
        masters = [m.detach() for m in amp.master_params(opt)]
        if i == 3:  # skipped: the sync alone (slow moved half-way to unchanged fast weights)
            expected = [opt.slow[m] for m in amp.master_params(opt)]
            _assert_bitwise(masters, expected)
            assert any(not torch.equal(a, b) for a, b in zip(masters, before))
        _assert_bitwise(_weights(model), [m.half() for m in masters])


class StepsTwice(AcceleratedLikeOptimizer):
    """A wrapper whose step runs the inner step twice (an extragradient or line-search shape)."""

    def step(self, closure=None):
        self.optimizer.step(closure)
        return self.optimizer.step(closure)


def test_inner_steps_inside_a_wrapper_step_see_each_other_under_o2():
    """Inside the wrapper's step the model follows the masters after each inner step: a closure
    evaluated by the second inner step and a step post-hook read the stepped weights."""
    from peak.optimizers import LARC
    torch.manual_seed(0)
    model = make_mlp()
    model, opt = amp.initialize(model, StepsTwice(LARC(TORCH["SGD"](model.parameters()))),
                                opt_level="O2", verbosity=0)
    evaluations, hooked = [], []
    opt.optimizer.register_step_post_hook(lambda *_: hooked.append(_weights(model)))
    for i in range(3):
        x, y = data(i)

        def closure():
            opt.zero_grad()
            evaluations.append(all(torch.equal(p, m.half()) for p, m in zip(
                model.parameters(), amp.master_params(opt))))
            with amp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
                scaled.backward()
            return scaled

        opt.step(closure)
        _assert_bitwise(hooked[-1], _weights(model))
    assert evaluations == [True] * 6 and len(hooked) == 6
    assert not torch.equal(hooked[0][0], hooked[1][0])  # (the second inner step stepped)


@pytest.mark.parametrize("name", ["Adam-fused", "FusedAdam"])
def test_a_skip_holds_for_every_inner_step_of_a_wrapper_step(name):
    """A device skip (a fused step's flag) inside a wrapper that steps twice on one backward:
    both inner steps skip (the masters' inf gradients stay until the wrapper returns), nothing
    turns NaN, and the next step steps."""
    make = {"Adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True), **FUSED}[name]

    class TwiceOnOneBackward(AcceleratedLikeOptimizer):
        def step(self, closure=None):
            self.optimizer.step()
            return self.optimizer.step()

    torch.manual_seed(0)
    model = make_mlp()
    model, opt = amp.initialize(model, TwiceOnOneBackward(make(model.parameters())),
                                opt_level="O2", verbosity=0)
    for i in range(3):
        x, y = data(i)
        before = _weights(model) + [m.detach().clone() for m in amp.master_params(opt)]
        opt.zero_grad()
        with amp.scale_loss(F.cross_entropy(model(x), y) * (float("inf") if i == 1 else 1.0),
                            opt) as scaled:
            scaled.backward()
        opt.step()
        after = _weights(model) + [m.detach().clone() for m in amp.master_params(opt)]
        if i == 1:
            _assert_bitwise(after, before)
        else:
            assert all(torch.isfinite(t).all() for t in after)
            assert not torch.equal(after[0], before[0])


def test_broken_optimizer_subclass_is_refused_before_anything_changes():
    class Broken(torch.optim.Optimizer):
        def __init__(self, params):  # noqa: D107 (forgets Optimizer.__init__; no inner optimizer)
            self.param_groups = [{"params": list(params)}]

    model = make_mlp()
    weights, forward = _weights(model), model.forward
    with pytest.raises(TypeError, match="did not run torch.optim.Optimizer.__init__"):
        amp.initialize(model, Broken(model.parameters()), opt_level="O2", verbosity=0)
    _assert_bitwise(_weights(model), weights)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.forward == forward and "forward" not in model.__dict__


# ---- 6. gradients after a fused step --------------------------------------------------------
def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name", list(FUSED))
def test_grads_unscaled_after_grad_scaler_step(name, dtype):
    """peak's and torch's GradScaler with a fused optimizer: p.grad holds grad / scale after the
    step, as torch's fused optimizers leave it (compare: unscale by hand)."""
    for scaler_cls in (amp.GradScaler, torch.amp.GradScaler):
        model = make_mlp().to(dtype)
        opt = FUSED[name](model.parameters())
        scaler = scaler_cls("cpu", init_scale=2.0**11)
        x, y = data(0)
        loss = F.cross_entropy(model(x.to(dtype)).float(), y)
        scaler.scale(loss).backward()
        expected = [g / 2.0**11 for g in _grads(model)]
        scaler.step(opt)
        scaler.update()
        _assert_bitwise(_grads(model), expected)


def test_grads_stay_scaled_after_a_skipped_fused_step():
    model = make_mlp().to(torch.float16)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    scaler = amp.GradScaler("cpu", init_scale=2.0**11)
    x, y = data(0)
    scaler.scale(F.cross_entropy(model(x.half()).float(), y)).backward()
    model[0].bias.grad[0] = float("inf")
    before = _grads(model)
    scaler.step(opt)
    _assert_bitwise(_grads(model), before)


@pytest.mark.parametrize("name", list(FUSED))
def test_grads_unscaled_after_amp_o2_fused_step(name):
    model = make_mlp()
    opt = FUSED[name](model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = data(0)
    with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as s:
        s.backward()
    scale = amp._amp_state.loss_scalers[0].loss_scale()  # (not grown after one step)
    assert scale > 1
    expected = [g / scale for g in _grads(model)]
    opt.step()
    _assert_bitwise(_grads(model), expected)


def test_store_unscaled_grads_opt_out_leaves_grads_as_they_were():
    model = make_mlp().to(torch.float16)
    opt = FusedSGD(model.parameters(), lr=0.1, store_unscaled_grads=False)
    scaler = amp.GradScaler("cpu", init_scale=2.0**11)
    x, y = data(0)
    scaler.scale(F.cross_entropy(model(x.half()).float(), y)).backward()
    before = _grads(model)
    scaler.step(opt)
    _assert_bitwise(_grads(model), before)


def test_bias_gradient_reads_its_true_value_after_step():
    """The issue's example: a bias whose true gradient is 2.0 read 2048.0."""
    model = nn.Linear(3, 1).half()
    opt = FusedSGD(model.parameters(), lr=0.0)
    scaler = amp.GradScaler("cpu", init_scale=1024.0)
    out = model(torch.zeros(2, 3, dtype=torch.float16)).float().sum()
    scaler.scale(out).backward()
    scaler.step(opt)
    assert model.bias.grad.item() == 2.0


# ---- 7. amp.master_params under fused O2 ----------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_master_params_fused_o2_yield_fp32_masters_and_clip_like_non_fused(dtype):
    def run(opt_cls):
        model = make_mlp()
        opt = opt_cls(model.parameters(), lr=0.5)
        model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=dtype,
                                    verbosity=0)
        norms = []
        for i in range(3):
            x, y = data(i)
            with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as s:
                s.backward()
            params = list(amp.master_params(opt))
            assert all(p.dtype == torch.float32 for p in params)
            norms.append(torch.nn.utils.clip_grad_norm_(params, max_norm=0.05))
            opt.step()
            opt.zero_grad()
        return torch.stack(norms), _weights(model)

    n_fused, w_fused = run(FusedSGD)
    amp._amp_state.reset()
    n_torch, w_torch = run(torch.optim.SGD)
    assert torch.equal(n_fused, n_torch)
    assert (n_fused > 0.05).all()  # clipping happened
    for a, b in zip(w_fused, w_torch):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0)


@pytest.mark.parametrize("loss_factor", [1.0, 1e-4], ids=["plain", "tiny-grads"])
@pytest.mark.parametrize("name", list(FUSED))
def test_reading_master_params_does_not_change_the_step(name, loss_factor):
    """Tiny gradients: unscaled in fp16 they would be subnormal (bits lost); the masters' fp32
    gradients keep them, and the step is the one without reading."""
    def run(read):
        model = make_mlp()
        opt = FUSED[name](model.parameters())
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        for i in range(3):
            x, y = data(i)
            with amp.scale_loss(F.cross_entropy(model(x).float(), y) * loss_factor, opt) as s:
                s.backward()
            if read:
                list(amp.master_params(opt))
                list(amp.master_params(opt))  # twice: still one set of gradients
            opt.step()
            opt.zero_grad()
        return _weights(model), [m.clone() for m in amp.master_params(opt)]

    w_read, m_read = run(True)
    amp._amp_state.reset()
    w_plain, m_plain = run(False)
    _assert_bitwise(w_read, w_plain)
    _assert_bitwise(m_read, m_plain)


def test_master_params_between_micro_batches_is_refused():
    model = make_mlp()
    opt = FusedAdam(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = data(0)
    with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as s:
        s.backward()
    list(amp.master_params(opt))
    with pytest.raises(RuntimeError, match="once per step"):
        with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as s:
            s.backward()


def test_master_params_skipped_step_leaves_everything_bitwise():
    model = make_mlp()
    opt = FusedAdam(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = data(0)
    with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as s:
        s.backward()
        model[0].weight.grad[0, 0] = float("inf")
    masters = list(amp.master_params(opt))
    weights, saved = _weights(model), [m.clone() for m in masters]
    opt.step()
    _assert_bitwise(_weights(model), weights)
    _assert_bitwise([m.clone() for m in amp.master_params(opt)], saved)


# ---- 8. training that silently does nothing -------------------------------------------------
def test_o2_backward_outside_scale_loss_warns_once():
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps opt.step in torch's frames
    x, y = data(0)
    with pytest.warns(UserWarning, match="amp.scale_loss") as w:
        F.cross_entropy(model(x).float(), y).backward()
        opt.step()
    assert w[0].filename == __file__  # the script's step() line, through the scheduler's wrapper
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.zero_grad()
        F.cross_entropy(model(x).float(), y).backward()
        opt.step()


def test_o2_scale_loss_path_does_not_warn():
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = data(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as s:
            s.backward()
        opt.step()


def test_o2_initialize_without_optimizer_warns_when_training_starts():
    model = make_mlp()
    model = amp.initialize(model, opt_level="O2", verbosity=0)
    x, y = data(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(x)  # inference: nothing to say
    with pytest.warns(UserWarning, match="no optimizer") as w:
        F.cross_entropy(model(x).float(), y).backward()
    assert w[0].filename == __file__  # the script's backward(), not torch's autograd engine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.cross_entropy(model(x).float(), y).backward()  # once


# ---- 9. Apex's keywords ---------------------------------------------------------------------
@pytest.mark.parametrize("cls", [FusedSGD, FusedAdam, FusedAdamW, FusedLAMB, FusedMixedPrecisionLamb,
                                 FusedAdagrad, FusedNovoGrad], ids=lambda c: c.__name__)
def test_apex_keywords_accepted_and_checked(cls):
    model = make_mlp()
    for kwargs in ({"materialize_master_grads": False}, {"capturable": True},
                   {"capturable": False}):
        opt = cls(model.parameters(), lr=0.1, **kwargs)
        assert opt.param_groups[0]["capturable"] == kwargs.get("capturable", False)
    with pytest.raises(ValueError, match="capturable must be True or False"):
        cls(model.parameters(), lr=0.1, capturable="yes")
    with pytest.raises(ValueError, match="materialize_master_grads must be True or False"):
        cls(model.parameters(), lr=0.1, materialize_master_grads=None)


@pytest.mark.parametrize("kwargs", [{"materialize_master_grads": False}, {"capturable": True}])
def test_apex_keywords_step_alike(kwargs):
    def run(kw):
        model = make_mlp().half()
        opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, **kw)
        scaler = amp.GradScaler("cpu")
        for i in range(3):
            x, y = data(i)
            opt.zero_grad()
            scaler.scale(F.cross_entropy(model(x.half()).float(), y)).backward()
            scaler.step(opt)
            scaler.update()
        return _weights(model)

    _assert_bitwise(run(kwargs), run({}))


# ---- 10. unskipped at every opt_level -------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_unskipped_counts_clean_updates_at_every_level(level, dtype):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp.initialize(model, opt, opt_level=level, low_precision_dtype=dtype,
                                verbosity=0)
    for i in range(3):
        x, y = data(i)
        with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as s:
            s.backward()
        opt.step()
        opt.zero_grad()
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 3


# ---- 11. exact state_dict round trip --------------------------------------------------------
@pytest.mark.parametrize("name", list(FUSED))
def test_fused_state_dict_round_trip_is_identical(name):
    model = make_mlp()
    opt = FUSED[name](model.parameters())
    x, y = data(0)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    sd = opt.state_dict()
    fresh = FUSED[name](make_mlp().parameters())
    fresh.load_state_dict(copy.deepcopy(sd))
    again = fresh.state_dict()
    assert again["param_groups"] == sd["param_groups"]
    assert again["state"].keys() == sd["state"].keys()
    for k in sd["state"]:
        for key, value in sd["state"][k].items():
            assert torch.equal(again["state"][k][key], value)


def test_o2_with_a_fused_optimizer_without_masters_keeps_none():
    """FusedSGD(master_weights=False, stochastic_rounding=True) under O2: amp must not hand it
    fp32 masters (its step then refused them); the bf16 weights are stepped directly."""
    model = make_mlp()
    opt = FusedSGD(model.parameters(), lr=0.1, master_weights=False, stochastic_rounding=True)
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=torch.bfloat16,
                                verbosity=0)
    x, y = data(0)
    before = _weights(model)
    with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as s:
        s.backward()
    opt.step()
    assert all("master_param" not in opt.state[p] for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, _weights(model)))


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_a_whole_model_and_optimizer_saved_after_initialize_load_and_run(level):
    """torch.save(model) (and of the optimizer) after initialize: the files load, the loaded
    model's forward casts as the saved one's did, and amp's patches keep a bound method's
    signature."""
    import inspect
    import io

    model = make_mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, low_precision_dtype="bf16",
                                verbosity=0)
    x = torch.randn(4, model[0].in_features)
    buf = io.BytesIO()
    torch.save({"model": model, "opt": opt}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    out, out_loaded = model(x), loaded["model"](x)
    assert out_loaded.dtype == out.dtype
    _assert_bitwise(out_loaded, out)
    assert list(inspect.signature(opt.step).parameters) == ["closure"]
    assert loaded["opt"].step.__self__ is loaded["opt"]
    import weakref
    assert weakref.ref(model.forward)() is model.forward and "bound method" in repr(opt.step)


def test_o1_with_a_dynamic_scale_unscales_sparse_gradients():
    """nn.Embedding(sparse=True) under O1 fp16 with the dynamic loss scale: the sparse gradient
    is unscaled at the scale_loss exit (it crashed in the multi-tensor kernel) and steps as the
    unscaled backward's gradient (a power-of-two scale is exact)."""
    grads = []
    for scaled in (True, False):
        torch.manual_seed(0)
        emb, lin = nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1)
        opt = torch.optim.SGD(list(emb.parameters()) + list(lin.parameters()), lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            [emb, lin], opt = amp.initialize([emb, lin], opt, opt_level="O1",
                                             low_precision_dtype=torch.float16, verbosity=0)
        loss = lin(emb(torch.tensor([1, 2, 3, 2]))).float().sum() / 1024  # (2**16 fits fp16)
        if scaled:
            with amp.scale_loss(loss, opt) as s:
                s.backward()
        else:
            loss.backward()
        assert emb.weight.grad.is_sparse
        grads.append(emb.weight.grad.to_dense())
        before = emb.weight.detach().clone()
        opt.step()
        grads.append(emb.weight.detach() - before)
    assert torch.equal(grads[0], grads[2]) and grads[0].abs().sum() > 0
    assert torch.equal(grads[1], grads[3]) and grads[1].abs().sum() > 0  # (the steps)


def test_o1_runs_the_spectral_norm_parametrization():
    """torch's spectral_norm parametrization takes vdot(u, mv(W, v)) with mv on O1's low list:
    vdot promotes (beside Apex's lists), so it runs, as under torch.autocast."""
    from torch.nn.utils.parametrizations import spectral_norm

    model = spectral_norm(nn.Linear(6, 6))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", low_precision_dtype="bf16",
                                verbosity=0)
    out = model(torch.randn(3, 6))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert amp.lists.policy_of(torch.vdot) == "promote"


def test_o1_unscales_sparse_gradients_that_share_values_once():
    """Token and position embeddings added together: autograd gives both sparse gradients values
    that may share memory; each is unscaled once (in its own copy), as the fp32 gradients, and an
    optimizer with only sparse parameters does not warn that it got no gradient."""
    torch.manual_seed(0)
    tok, pos, lin = (nn.Embedding(10, 4, sparse=True), nn.Embedding(8, 4, sparse=True),
                     nn.Linear(4, 1))
    ref = copy.deepcopy([tok, pos, lin])
    opt = torch.optim.SGD([*tok.parameters(), *pos.parameters()], lr=0.1)
    opt_lin = torch.optim.SGD(lin.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        [tok, pos, lin], [opt, opt_lin] = amp.initialize(
            [tok, pos, lin], [opt, opt_lin], opt_level="O1", low_precision_dtype=torch.float16,
            verbosity=0)
    idx, at = torch.tensor([1, 2, 3, 2]), torch.arange(4)
    loss = lin(tok(idx) + pos(at)).float().sum() / 1024
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with amp.scale_loss(loss, [opt, opt_lin]) as s:
            s.backward()
    with amp.disable_casts():
        (ref[2](ref[0](idx) + ref[1](at)).sum() / 1024).backward()
    for m, r in zip((tok, pos), ref):
        torch.testing.assert_close(m.weight.grad.to_dense(), r.weight.grad.to_dense(),
                                   rtol=2e-3, atol=0)


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_o2_steps_sparse_embedding_gradients_as_dense_ones(dtype, set_to_none):
    """nn.Embedding(sparse=True) under O2: its master (fp32) gets the unscaled sparse gradient
    (it raised in the multi-tensor kernel) and steps as the same model with a dense embedding,
    bit for bit: over two backward passes per step, through an overflowed step (skipped, the
    scale halved alike), and after zero_grad(set_to_none=False) (its zero stays sparse)."""
    results = []
    for sparse in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 4, sparse=sparse), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt = amp.initialize(model, opt, opt_level="O2", cast_model_type=dtype,
                                        loss_scale="dynamic", verbosity=0)
        for step in range(4):
            for idx in (torch.tensor([1, 2, 3]), torch.tensor([5, 2, 7])):
                loss = model(idx).float().sum() * (float("inf") if step == 1 else 1.0)
                with amp.scale_loss(loss, opt) as s:
                    s.backward()
            assert model[0].weight.grad.is_sparse is sparse
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        masters = [m.detach().clone() for m in amp.master_params(opt)]
        results.append((masters, [p.detach().clone() for p in model.parameters()],
                        amp.state_dict()["loss_scaler0"]["loss_scale"]))
    (masters, weights, scale), (masters_d, weights_d, scale_d) = results
    assert scale == scale_d < 2.0**16
    for a, b in zip(masters + weights, masters_d + weights_d):
        _assert_bitwise(a, b)
    torch.manual_seed(0)
    assert not torch.equal(masters[0], nn.Embedding(10, 4).weight)  # (it trained)


@pytest.mark.parametrize("level, optimizer", [
    ("O2", "Adam"), ("O2", "FusedAdam"),
    # (these raised "object has no attribute 'found_inf'": Dynamo lost the attribute amp set
    # for the step before a graph break inside it; amp's step is eager, whole, now)
    ("O2", "Adam(fused=True)"), ("O1", "FusedAdam"), ("O1", "Adam(fused=True)")])
def test_o2_training_step_compiled_whole(level, optimizer):
    """A whole O2 step in one torch.compile'd function (forward through amp's patched forward,
    scale_loss, a clip of the masters, step): Dynamo failed a guard it had made on the patched
    forward ("getattr failed on source ...forward.__dict__"). It now trains as the eager step:
    the same scale trace through an overflow, weights within a few fp16 ulps (inductor's kernels
    round differently from eager ones)."""
    def run(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        opt = {"Adam": torch.optim.Adam, "FusedAdam": FusedAdam,
               "Adam(fused=True)": functools.partial(torch.optim.Adam, fused=True)}[optimizer](
            model.parameters(), lr=1e-2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt = amp.initialize(model, opt, opt_level=level, loss_scale="dynamic",
                                        low_precision_dtype=torch.float16, verbosity=0)

        def step(x, y, mult):
            loss = F.cross_entropy(model(x), y) * mult
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0)
            opt.step()
            opt.zero_grad()

        fn = torch.compile(step) if compiled else step
        g = torch.Generator().manual_seed(1)
        scales = []
        for i in range(4):
            x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
            x = x.half() if level == "O2" else x
            fn(x, y, torch.tensor(float("inf") if i == 2 else 1.0))
            scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
        return scales, [p.detach().float() for p in model.parameters()]

    (eager_scales, eager), (scales, weights) = run(False), run(True)
    assert scales == eager_scales and scales[2] < scales[1]
    torch.manual_seed(0)
    start = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    for w, e, s in zip(weights, eager, start.parameters()):
        torch.testing.assert_close(w, e, rtol=0, atol=4e-3)  # (steps of lr=1e-2: they moved)
        assert (e - s.detach()).abs().max() > 5e-3


def test_torch_export_at_o2_matches_eager_and_at_o1_is_refused_by_torch():
    """docs/caster.md: an O2 model (cast weights, amp's patched forward) exports and the program
    gives the eager output; an O1 model's export fails inside the caster's wrappers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=torch.bfloat16,
                                verbosity=0)
    x = torch.randn(3, 8)
    program = torch.export.export(model, (x,))
    assert torch.equal(program.module()(x), model(x)) and model(x).dtype == torch.float32
    o1 = nn.Linear(8, 4)
    o1, _ = amp.initialize(o1, torch.optim.SGD(o1.parameters(), lr=0.1), opt_level="O1",
                           low_precision_dtype=torch.bfloat16, verbosity=0)
    with pytest.raises(RuntimeError, match="Cannot access data pointer"):
        torch.export.export(o1, (x,), strict=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_o2_sparse_gradients_with_duplicate_rows_and_sparse_adam(dtype):
    """O2 with SparseAdam on a sparse embedding: duplicate rows reach the fp32 master as the
    unscaled values (summed in fp32, not in the low dtype); zero_grad(set_to_none=False) gives
    the same run as set_to_none=True (SparseAdam refuses a dense zero)."""
    runs = []
    for set_to_none in (True, False):
        torch.manual_seed(0)
        emb, head = nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1)
        opts = [torch.optim.SparseAdam(emb.parameters(), lr=0.1),
                torch.optim.SGD(head.parameters(), lr=0.1)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            [emb, head], opts = amp.initialize([emb, head], opts, opt_level="O2",
                                               cast_model_type=dtype, verbosity=0)
        idx = torch.tensor([2] * 300 + [4])
        for _ in range(3):
            scale = amp.state_dict()["loss_scaler0"]["loss_scale"]  # (no overflow: / 4096)
            with amp.scale_loss(head(emb(idx)).float().sum() / 4096, opts) as scaled:
                scaled.backward()
            master = next(amp.master_params(opts[0]))
            expected = emb.weight.grad.double().to_dense() / scale
            torch.testing.assert_close(master.grad.to_dense().double(), expected, rtol=1e-6, atol=0)
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
        runs.append(next(amp.master_params(opts[0])).detach().clone())
    assert torch.equal(runs[0], runs[1])


def test_o2_fused_optimizer_with_a_sparse_gradient_is_refused_by_name():
    """O2 fp16 with a dynamic scale and FusedAdam over a sparse embedding: the scale_loss exit's
    check reads the sparse values (it raised the kernel's "SparseCPU backend" error), and the step
    refuses the sparse gradient with the fix, the weights untouched."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    opt = FusedAdam(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic",
                                    low_precision_dtype=torch.float16, verbosity=0)
    before = [p.detach().clone() for p in model.parameters()]
    with amp.scale_loss(model(torch.tensor([1, 2, 2])).float().sum(), opt) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match="FusedAdam does not support sparse .*SparseAdam"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


# ---- 12. weights written between steps under master weights ---------------------------------
def _renormed_embedding_run(make_opt, steps=12, under_amp=True):
    """nn.Embedding(max_norm=1) renormalises the looked-up rows of its weight in place, in the
    forward: the masters must follow, or each step's copy-back undoes the renormalisation."""
    torch.manual_seed(0)
    model = nn.Embedding(40, 16, max_norm=1.0)
    opt = make_opt(model.parameters())
    if under_amp:
        model, opt = amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16,
                                    loss_scale=1.0, verbosity=0)
    for s in range(steps):
        ids = torch.randint(0, 40, (8,), generator=torch.Generator().manual_seed(s))
        loss = model(ids).float().square().sum()
        with amp.scale_loss(loss, opt) if under_amp else contextlib.nullcontext(loss) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    return model.weight.detach().clone()


def test_masters_follow_weights_written_in_the_forward_with_a_torch_optimizer():
    """The fused optimizer's masters already followed such writes; amp's store for torch
    optimizers overwrote them at every step (the rows grew to norm 14 where fp32 keeps 1)."""
    torch_sgd = _renormed_embedding_run(lambda ps: torch.optim.SGD(ps, lr=0.1))
    amp._amp_state.reset()
    fused_sgd = _renormed_embedding_run(lambda ps: FusedSGD(ps, lr=0.1))
    _assert_bitwise([torch_sgd], [fused_sgd])
    amp._amp_state.reset()
    fp32 = _renormed_embedding_run(lambda ps: torch.optim.SGD(ps, lr=0.1), under_amp=False)
    torch.testing.assert_close(torch_sgd.float(), fp32, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("front", ["amp O2", "FP16_Optimizer"])
def test_a_weight_copied_in_between_steps_is_kept(front):
    """``weight.copy_(new)`` under no_grad between steps (an EMA swap, a pruning mask): the next
    step starts from it, as with fp32 weights; masters still equal to their weight are kept."""
    from peak.fp16_utils import FP16_Optimizer
    torch.manual_seed(0)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    if front == "amp O2":
        model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=1.0, verbosity=0)
    else:
        model = model.half()
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.0), static_loss_scale=1.0)
    first, other = model[0].weight, model[2].weight
    kept = other.detach().clone()
    for s in range(2):
        x, y = data(s)
        loss = F.cross_entropy(model(x.to(first.dtype)).float(), y)
        if front == "amp O2":
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        else:
            opt.backward(loss)
        if s == 0:
            with torch.no_grad():
                first.copy_(torch.full_like(first, 0.25))
        opt.step()
        opt.zero_grad()
    assert (first == 0.25).all()
    _assert_bitwise([other.detach()], [kept])


def test_master_edits_after_the_backward_survive_a_weight_written_in_the_forward():
    """Decoupled weight decay on ``amp.master_params`` between the backward and the step, with a
    weight the forward writes (``max_norm`` renormalises in place even where nothing is over the
    limit): the masters follow the weights at the backward, before the edit, so the decay lands
    (it was undone where the masters followed at the step)."""
    def run(under_amp, steps=100, decay=1e-3):
        amp._amp_state.reset()
        torch.manual_seed(0)
        model = nn.Embedding(100, 16, max_norm=100.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        if under_amp:
            model, opt = amp.initialize(model, opt, opt_level="O2",
                                        cast_model_type=torch.bfloat16, loss_scale=1.0,
                                        verbosity=0)
        params = list(amp.master_params(opt)) if under_amp else list(model.parameters())
        for s in range(steps):
            ids = torch.randint(0, 100, (4,), generator=torch.Generator().manual_seed(s))
            loss = model(ids).float().sum()
            with amp.scale_loss(loss, opt) if under_amp else contextlib.nullcontext(loss) as sl:
                sl.backward()
            with torch.no_grad():
                for p in params:
                    p.mul_(1 - decay)
            opt.step()
            opt.zero_grad()
        return model.weight.detach().float()
    torch.testing.assert_close(run(True), run(False), rtol=1e-2, atol=1e-2)


def test_fp16_optimizer_follows_a_write_made_in_its_closure():
    """``FP16_Optimizer.step(closure)``: the closure's forward renormalises embedding rows; the
    masters follow at its backward, as without a closure."""
    from peak.fp16_utils import FP16_Optimizer

    def run(use_closure, steps=6):
        torch.manual_seed(0)
        model = nn.Embedding(40, 16, max_norm=1.0).half()
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=1.0,
                             verbose=False)
        for s in range(steps):
            ids = torch.randint(0, 40, (8,), generator=torch.Generator().manual_seed(s))

            def closure():
                opt.zero_grad()
                loss = model(ids).float().square().sum()
                opt.backward(loss)
                return loss
            if use_closure:
                opt.step(closure)
            else:
                closure()
                opt.step()
        return model.weight.detach().clone()
    _assert_bitwise([run(True)], [run(False)])


_PRUNED_RUNS = {  # optimizer, under amp O2
    "torch SGD, amp": (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), True),
    "FusedSGD, amp": (lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9), True),
    "FusedAdam remainders, amp": (lambda ps: FusedAdam(ps, lr=1e-3,
                                                       store_param_remainders=True), True),
    "FusedAdam": (lambda ps: FusedAdam(ps, lr=1e-3), False),
    "FusedAdam remainders": (lambda ps: FusedAdam(ps, lr=1e-3, store_param_remainders=True),
                             False)}


@pytest.mark.parametrize("rewrite", [False, True], ids=["", "written again after the loads"])
@pytest.mark.parametrize("run_kind", list(_PRUNED_RUNS))
@pytest.mark.parametrize("model_first", [True, False], ids=["model first", "optimizer first"])
def test_a_resume_after_a_weight_written_between_steps_is_bit_for_bit(model_first, run_kind,
                                                                      rewrite):
    """A pruning mask applied after each step (``weight.mul_(mask)``), a checkpoint between steps:
    the resumed run is the uninterrupted one, in either load order (the loads took the whole
    tensor's weights for masters, where the uninterrupted run keeps each master that still rounds
    to its weight; a fused optimizer saved the masters the write had left behind, and its load
    put them back into the model). With ``rewrite`` the weight is written again after the loads,
    before the first step (a mask re-applied on resuming): a fused optimizer's first step took
    its loaded masters over that write."""
    mask = torch.arange(48).reshape(8, 6) % 7 != 0
    make_opt, under_amp = _PRUNED_RUNS[run_kind]

    def build():
        amp._amp_state.reset()
        model = make_mlp()
        if not under_amp:
            model = model.to(torch.bfloat16)
            return model, make_opt(model.parameters())
        return amp.initialize(model, make_opt(model.parameters()), opt_level="O2",
                              cast_model_type=torch.bfloat16, loss_scale=1.0, verbosity=0)

    def run(steps, resume_at=None, write_at=None):
        model, opt = build()
        for s in range(steps):
            if s == resume_at:
                saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
                model, opt = build()
                loads = [lambda: model.load_state_dict(saved[0]),
                         lambda: opt.load_state_dict(saved[1])]
                for load in loads if model_first else loads[::-1]:
                    load()
            if s == write_at:
                with torch.no_grad():
                    model[0].weight[:, 1].fill_(0.25)
            x, y = data(s)
            if under_amp:
                with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
                    scaled.backward()
            else:
                F.cross_entropy(model(x.bfloat16()).float(), y).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                model[0].weight.mul_(mask)
        masters = amp.master_params(opt) if under_amp else [opt.master_of(p)
                                                              for p in model.parameters()]
        return _weights(model) + [m.detach().clone() for m in masters]
    write_at = 4 if rewrite else None
    _assert_bitwise(run(8, resume_at=4, write_at=write_at), run(8, write_at=write_at))


# ---- 13. an LR scheduler built before amp.initialize (Lightning, Accelerate) ------------------
@pytest.mark.parametrize("name", ["SGD", "FusedSGD"])
def test_a_scheduler_built_before_initialize_keeps_torchs_order_check(name):
    """amp binds its step over the one torch's scheduler wrapped: torch warned "optimizer.step()
    has been overridden after learning rate scheduler initialization" at every run, and lost its
    real check (scheduler.step() before optimizer.step()), which must still warn."""
    for misordered in (False, True):
        amp._amp_state.reset()
        model = make_mlp()
        opt = {**TORCH, **FUSED}[name](model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        model, opt = amp.initialize(model, opt, opt_level="O2", cast_model_type=torch.bfloat16,
                                    verbosity=0)
        x, y = data(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if misordered:
                sched.step()
            with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
                scaled.backward()
            opt.step()
            sched.step()
        messages = [str(w.message) for w in caught]
        assert not any("overridden" in m for m in messages)
        assert any("before `optimizer.step()`" in m for m in messages) == misordered
        assert opt.param_groups[0]["lr"] == {**TORCH, **FUSED}[name](
            [torch.zeros(1, requires_grad=True)]).param_groups[0]["lr"] * 0.5 ** (1 + misordered)


@pytest.mark.parametrize("hook", ["pre", "post"])
@pytest.mark.parametrize("make_opt", list(TORCH.values()) + [FUSED["FusedAdam"]],
                         ids=list(TORCH) + ["FusedAdam"])
def test_an_interrupted_step(make_opt, hook):
    """An O2 step that raises (Ctrl-C) before it changes anything (a step pre-hook) keeps the
    masters' gradients: called again, it steps as the uninterrupted run (the torch path dropped
    them, and the retry stepped nothing). One that raises after it wrote the masters (a
    post-hook) still leaves the model with their rounding, as an fp32 model would have the step:
    training that goes on equals the uninterrupted run (the model was left behind)."""
    def run(interrupt):
        model = make_mlp()
        opt = make_opt(model.parameters())
        model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=torch.bfloat16,
                                    verbosity=0)
        armed = [False]

        def raise_once(*_):
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt

        (opt.register_step_pre_hook if hook == "pre" else opt.register_step_post_hook)(raise_once)
        for i in range(3):
            x, y = data(i)
            opt.zero_grad()
            with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
                scaled.backward()
            if i == 1 and interrupt:
                armed[0] = True
                with pytest.raises(KeyboardInterrupt):
                    opt.step()
                if hook == "post":
                    continue  # (it stepped)
            opt.step()
        return _weights(model) + [m.detach().clone() for m in amp.master_params(opt)]

    amp._amp_state.reset()
    _assert_bitwise(run(True), run(False))


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("set_grad_none", [False, True])
def test_zero_grad_follows_the_fused_optimizers_set_grad_none(level, set_grad_none):
    """``opt.zero_grad()`` under amp keeps the constructor's ``set_grad_none`` (Apex's option) as
    the optimizer's own zero_grad does: False zeroes the gradients (amp made it True), so a
    weight the next pass does not reach is still stepped on momentum, as without amp."""
    model = make_mlp()
    opt = FusedSGD(model.parameters(), lr=0.1, momentum=0.9, set_grad_none=set_grad_none)
    model, opt = amp.initialize(model, opt, opt_level=level, low_precision_dtype=torch.bfloat16,
                                verbosity=0)
    x, y = data(0)
    with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
        scaled.backward()
    opt.step()
    opt.zero_grad()
    grads = [p.grad for p in model.parameters()]
    if set_grad_none:
        assert all(g is None for g in grads)
    else:
        assert all(g is not None and not g.any() for g in grads)
    opt.zero_grad(set_to_none=True)  # an explicit argument still wins
    assert all(p.grad is None for p in model.parameters())
    amp._amp_state.reset()


@pytest.mark.parametrize("world_size", [None, "1", "2"])
@pytest.mark.parametrize("make_opt", [TORCH["SGD"], FUSED["FusedAdam"]], ids=["SGD", "FusedAdam"])
def test_masters_start_from_the_cast_weights_in_a_multi_rank_run(monkeypatch, world_size, make_opt):
    """In one process O2's masters start as the exact fp32 weights; in a multi-rank run (here a
    launcher's WORLD_SIZE, set before any process group) from the cast weights, which DDP's
    broadcast makes the same on every rank (tests/distributed/test_ddp.py runs the ranks)."""
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    model = make_mlp()
    fp32 = _weights(model)
    opt = make_opt(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=torch.bfloat16,
                                verbosity=0)
    x, y = data(0)
    with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
        scaled.backward()  # (a fused optimizer makes a missing master at its first step's entry)
    masters = [m.detach().clone() for m in amp.master_params(opt)]
    expected = [w.bfloat16().float() for w in fp32] if world_size == "2" else fp32
    _assert_bitwise(masters, expected)
    amp._amp_state.reset()


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("low", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("opt_name", ["SGD", "FusedAdam"])
def test_a_second_initialize_with_the_same_options_leaves_the_first_training(level, low,
                                                                            opt_name):
    """Apex's own checkpoint test trains a restored model beside the first after a second
    ``initialize`` (and scripts initialize an EMA or eval copy later): with the same options
    the first model and optimizer keep training, bit for bit as without the second call (which
    gives the run new loss scalers, as Apex's: at their initial scale here, as the first's)."""
    make = {**TORCH, **FUSED}[opt_name]
    runs = []
    for second in (False, True):
        model = make_mlp(0)
        opt = make(model.parameters())
        amp.initialize(model, opt, opt_level=level, low_precision_dtype=low, num_losses=2,
                       verbosity=0)
        for step in range(4):
            if second and step == 2:
                other = make_mlp(1)
                amp.initialize(other, make(other.parameters()), opt_level=level,
                               low_precision_dtype=low, num_losses=2, verbosity=0)
            x, y = data(step)
            opt.zero_grad()
            with amp.scale_loss(F.cross_entropy(model(x), y), opt, loss_id=0) as scaled:
                scaled.backward()
            opt.step()
        runs.append(_weights(model))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises (an out-of-memory micro-batch) before any gradient of the
    layers below it is accumulated."""
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("simulated out of memory")


@pytest.mark.parametrize("failing", [1, 2])
@pytest.mark.parametrize("where", ["before_backward", "in_backward"])
@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("make_opt", list(TORCH.values()) + [FUSED["FusedAdam"]],
                         ids=list(TORCH) + ["FusedAdam"])
def test_a_micro_batch_that_raises_inside_scale_loss_leaves_the_accumulated_ones(make_opt, level,
                                                                                  where, failing):
    """Gradient accumulation where one micro-batch raises inside its scale_loss block (a caught
    out-of-memory, skipped): the step then equals the run that never had that micro-batch, bit
    for bit, weights, masters and loss scale."""
    def run(fail):
        model = make_mlp()
        opt = make_opt(model.parameters())
        model, opt = amp.initialize(model, opt, opt_level=level, low_precision_dtype=torch.float16,
                                    verbosity=0)
        for step in range(2):
            opt.zero_grad()
            for micro in range(3):
                if micro == failing and not fail:
                    continue
                x, y = data(10 * step + micro)
                try:
                    with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
                        if micro == failing and where == "before_backward":
                            raise RuntimeError("simulated out of memory")
                        if micro == failing:
                            scaled = _FailingBackward.apply(scaled)
                        scaled.backward()
                except RuntimeError as error:
                    assert micro == failing and "simulated out of memory" in str(error)
            opt.step()
        scale = amp._amp_state.loss_scalers[0].loss_scale()
        return _weights(model) + [m.detach().clone() for m in amp.master_params(opt)], scale

    amp._amp_state.reset()
    (weights, scale), (expected, expected_scale) = run(True), run(False)
    _assert_bitwise(weights, expected)
    assert scale == expected_scale


class _Scale4d(nn.Module):
    """A 4-d weight used elementwise: its values (and gradients) do not depend on its memory
    layout, so a run that changes the layout can be compared bit for bit with one that does not."""
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 48).reshape(1, 3, 4, 4))

    def forward(self, x):
        return x * self.weight


TORCH_CHANNELS_LAST = {"SGD": TORCH["SGD"], "Adam": TORCH["Adam"],
                       "Adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True)}


@pytest.mark.parametrize("when", ["before_the_first_step", "between_micro_batches",
                                  "then_a_resume"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("make_opt", list(TORCH_CHANNELS_LAST.values()),
                         ids=list(TORCH_CHANNELS_LAST))
def test_o2_masters_follow_a_channels_last_conversion_after_initialize(make_opt, dtype, when):
    """``model.to(memory_format=torch.channels_last)`` after ``amp.initialize`` (the masters were
    made in the old layout): O2 with a torch optimizer trains as the run without the conversion,
    bit for bit (the scale_loss exit raised: the masters' layout differed from the gradients'),
    also when a checkpoint is loaded into the converted model (the load's copy-back raised)."""
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(_Scale4d(), nn.Flatten(), nn.Linear(48, 3))
        opt = make_opt(model.parameters())
        return amp.initialize(model, opt, opt_level="O2", low_precision_dtype=dtype, verbosity=0)

    def run(convert):
        model, opt = build()
        if convert and when == "before_the_first_step":
            model.to(memory_format=torch.channels_last)
        for step in range(3):
            if convert and when == "then_a_resume" and step == 2:
                checkpoint = copy.deepcopy((model.state_dict(), opt.state_dict()))
                model, opt = build()
                model.to(memory_format=torch.channels_last)
                model.load_state_dict(checkpoint[0])
                opt.load_state_dict(checkpoint[1])
            opt.zero_grad()
            for micro in range(2):
                if convert and when == "between_micro_batches" and (step, micro) == (1, 1):
                    model.to(memory_format=torch.channels_last)
                g = torch.Generator().manual_seed(10 * step + micro)
                x = torch.randn(8, 3, 4, 4, generator=g)
                y = torch.randint(0, 3, (8,), generator=g)
                with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
                    scaled.backward()
            opt.step()
        weight, master = model[0].weight, amp.master_params(opt).__iter__().__next__()
        assert master.stride() == weight.stride() and master.shape == weight.shape
        return _weights(model) + [m.detach().clone() for m in amp.master_params(opt)]

    amp._amp_state.reset()
    converted, expected = run(True), run(False)
    assert not converted[0].is_contiguous()
    _assert_bitwise([t.contiguous() for t in converted], [t.contiguous() for t in expected])


class _OwnEightBitSGD(torch.optim.SGD):
    """An optimizer with 8-bit state of its own (as bitsandbytes' keep theirs: blocks in memory
    order, which a layout change would scramble)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p].setdefault("codes", torch.zeros_like(p, dtype=torch.uint8))
        return super().step(closure)


def test_a_layout_change_with_another_optimizers_8bit_state_is_refused_by_name():
    model = nn.Sequential(_Scale4d(), nn.Flatten(), nn.Linear(48, 3))
    opt = _OwnEightBitSGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=torch.bfloat16,
                                verbosity=0)
    x, y = torch.randn(8, 3, 4, 4), torch.randint(0, 3, (8,))
    with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
        scaled.backward()
    opt.step()
    model.to(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match=r"_OwnEightBitSGD keeps 8-bit state of its own "
                       r"\(\['codes'\]\).*Change the memory format before amp.initialize"):
        with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
            scaled.backward()


def test_a_master_of_a_parameter_with_gaps_is_laid_out_once():
    """FP16_Optimizer over a slice (a parameter with gaps, which no dense master can mirror): its
    master keeps one dense layout (it was copied at every call), and the steps equal those over
    a contiguous copy of the parameter, bit for bit."""
    from peak.fp16_utils import FP16_Optimizer

    def run(gapped):
        base = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)).half()
        weight = nn.Parameter(base[:, ::2] if gapped else base[:, ::2].contiguous())
        with pytest.warns(DeprecationWarning):
            opt = FP16_Optimizer(torch.optim.Adam([weight], lr=1e-2), static_loss_scale=8.0)
        master, pointers = opt.fp32_from_fp16_groups[0][0], set()
        for step in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step)).half()
            opt.zero_grad()
            opt.backward((x @ weight).float().pow(2).mean())
            opt.step()
            pointers.add(master.data_ptr())
        assert len(pointers) == 1 and weight.is_contiguous() != gapped
        return [weight.detach().clone(), master.detach().clone()]

    _assert_bitwise(run(True), run(False))


@pytest.mark.parametrize("name", ["FusedSGD", "FusedAdam"])
def test_o2_fused_masters_read_for_clipping_follow_a_channels_last_conversion(name):
    """A fused optimizer's masters follow a layout change at its step; amp.master_params (the
    clipping recipe) reads them before the step: it raised on the old layout's strides."""
    def run(convert):
        torch.manual_seed(0)
        model = nn.Sequential(_Scale4d(), nn.Flatten(), nn.Linear(48, 3))
        model, opt = amp.initialize(model, FUSED[name](model.parameters()), opt_level="O2",
                                    low_precision_dtype=torch.bfloat16, verbosity=0)
        for step in range(3):
            if convert and step == 1:
                model.to(memory_format=torch.channels_last)
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 3, 4, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt) as scaled:
                scaled.backward()
            torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.1)
            opt.step()
        return _weights(model) + [m.detach().clone() for m in amp.master_params(opt)]

    amp._amp_state.reset()
    converted, expected = run(True), run(False)
    assert not converted[0].is_contiguous()
    _assert_bitwise([t.contiguous() for t in converted], [t.contiguous() for t in expected])


def test_o2_step_compiled_whole_with_a_torch_optimizer_traces_no_master_loop():
    """The store's loop over its masters (each compared with its weight at the first step) was
    traced once per master: a model of more than 8 parameters reached Dynamo's recompile limit
    (a warning, the rest run eagerly). It runs eagerly now: nothing of it compiled, the eager
    step's bits."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from peak.optimizers import masters
    def run(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=torch.bfloat16,
                                    verbosity=0)

        def step(x):
            with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()

        fn = torch.compile(step, backend="eager") if compiled else step
        for i in range(3):
            fn(torch.randn(4, 8, generator=torch.Generator().manual_seed(i)))
        assert not _debug_get_cache_entry_list(masters.weight_wins.__code__)
        return _weights(model) + [m.detach().clone() for m in amp.master_params(opt)]

    _assert_bitwise(run(True), run(False))
