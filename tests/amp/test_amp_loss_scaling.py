"""Loss scaling through amp.scale_loss: overflow skips, growth, bounds, accumulation, several
models/optimizers/losses (spec §5)."""
import copy
import functools
import random

import pytest
import torch
from torch import nn

from peak import amp
from peak.amp import LossScaler
from peak.amp._amp_state import _amp_state

import amp_helpers as H
from peak_testing import assert_poisoned_steps_skipped

INF = float("inf")


# ------------------------------------------------------------------------------------------ the scaler alone
class ApexReferenceScaler:
    """Apex's update_scale (spec §5.3) restated in plain Python."""

    def __init__(self, dynamic, static_scale, window, min_scale, max_scale):
        self.dynamic = dynamic
        self.scale = min(max_scale, 2.0**16) if dynamic else static_scale
        self.window, self.min, self.max = window, min_scale, max_scale
        self.unskipped = 0

    def update(self, overflow):
        if overflow and self.dynamic:
            self.scale = max(self.min, self.scale / 2.0) if self.min else self.scale / 2.0
            self.unskipped = 0
            skip = True
        else:
            self.unskipped += 1
            skip = False
        if self.unskipped == self.window and self.dynamic:
            self.scale = min(self.max, self.scale * 2.0)
            self.unskipped = 0
        return skip


@pytest.mark.parametrize("dynamic, min_scale, max_scale", [
    (True, None, 2.0**24), (True, 2.0**13, 2.0**24), (True, None, 2.0**17), (True, 2.0**15, 2.0**16),
    (False, None, 2.0**24)], ids=["dyn", "dyn-min", "dyn-max", "dyn-min-max", "static"])
def test_scaler_matches_apex_algorithm(dynamic, min_scale, max_scale):
    window = 3
    ours = LossScaler("dynamic" if dynamic else 8.0, scale_window=window, min_loss_scale=min_scale,
                      max_loss_scale=max_scale)
    ref = ApexReferenceScaler(dynamic, 8.0, window, min_scale, max_scale)
    rng = random.Random(0)
    for i in range(200):
        overflow = rng.random() < 0.3
        ours.clear_overflow_state()
        if overflow:
            ours.found_inf.fill_(1.0)
        assert ours.update_scale() == ref.update(overflow), i
        assert ours.loss_scale() == ref.scale and ours._unskipped == ref.unskipped, i
    assert ours.scale.dtype == torch.float32 and ours.scale.shape == (1,)
    for t in (ours.growth_tracker, ours.hysteresis_tracker):
        assert t.dtype == torch.int32 and t.shape == (1,)
    assert ours.found_inf.dtype == torch.float32 and ours.found_inf.shape == (1,)


def test_scaler_state_dict_round_trip():
    a = LossScaler("dynamic")
    a._loss_scale, a._unskipped = 1024.0, 17
    b = LossScaler("dynamic")
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == {"loss_scale": 1024.0, "unskipped": 17}


# ------------------------------------------------------------------------------------------ helpers
def _model_opt(level, low, opt_cls=torch.optim.Adam, **kwargs):
    model = H.make_cnn()
    opt = opt_cls(model.parameters(), lr=1e-2)
    H.init(model, opt, level, low, **kwargs)
    return model, opt


def _loss(model, step):
    x, y = H.batch(step, n=8, shape=(3, 6, 6))
    return nn.functional.cross_entropy(model(x).float(), y)


def _train_step(model, opt, step, inject=False, **scale_kwargs):
    opt.zero_grad()
    loss = _loss(model, step)
    with amp.scale_loss(loss, opt, **scale_kwargs) as scaled:
        scaled.backward()
        if inject:
            with torch.no_grad():
                next(model.parameters()).grad.view(-1)[0] = INF
    opt.step()
    return loss


# ------------------------------------------------------------------------------------------ overflow
@pytest.mark.parametrize("level, low", H.CONFIGS)
def test_overflow_skips_exactly_that_step(level, low, capsys):
    # max 2**12: pure fp16 (O3) grads would overflow naturally at Apex's initial 2**16; Adam's eps=1e-8
    # underflows in fp16 (O3), hence 1e-4
    adam = functools.partial(torch.optim.Adam, eps=1e-4)
    model, opt = _model_opt(level, low, opt_cls=adam, loss_scale="dynamic", verbosity=1, max_loss_scale=2.0**12)
    scaler = _amp_state.loss_scalers[0]

    def step(i, poison):
        capsys.readouterr()
        _train_step(model, opt, i, inject=poison)
        return dict(out=capsys.readouterr().out, scale=scaler.loss_scale(), unskipped=scaler._unskipped,
                    params=H.snapshot(model, opt)["params"])

    # step 2 leaves weights, masters, optimizer state (Adam step counts too) bit for bit, halves
    runs = assert_poisoned_steps_skipped(step, 4, {2}, lambda: H.snapshot(model, opt),
                                         scale=scaler.loss_scale)
    assert (runs[1]["scale"], runs[1]["unskipped"]) == (2.0**12, 2)
    assert runs[2]["out"].endswith(
        "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 2048.0\n")
    assert (runs[2]["scale"], runs[2]["unskipped"]) == (2.0**11, 0)
    assert "Gradient overflow" not in runs[3]["out"]  # the next step is not skipped
    assert any(not torch.equal(a, b) for a, b in zip(runs[3]["params"], runs[2]["params"]))
    assert (runs[3]["scale"], runs[3]["unskipped"]) == (2.0**11, 1)


def test_overflow_message_apex_format(capsys):
    model, opt = _model_opt("O2", torch.float16, verbosity=1)
    capsys.readouterr()
    _train_step(model, opt, 0, inject=True)
    assert capsys.readouterr().out == "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0\n"


def test_verbosity_0_silences_overflow_message(capsys):
    model, opt = _model_opt("O2", torch.float16, verbosity=0)
    _train_step(model, opt, 0, inject=True)
    assert capsys.readouterr().out == ""
    assert _amp_state.loss_scalers[0].loss_scale() == 2.0**15


def test_nan_loss_skips_step():
    model, opt = _model_opt("O1", torch.float16, verbosity=0)
    before = H.snapshot(model, opt)
    opt.zero_grad()
    loss = _loss(model, 0) * float("nan")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    H.assert_bitwise_equal(H.snapshot(model, opt), before)


def test_several_overflows_skip_once():
    model, opt = _model_opt("O2", torch.float16, verbosity=0)
    before = H.snapshot(model, opt)
    opt.zero_grad()
    for step in range(2):  # two overflowing backward passes before one step()
        with amp.scale_loss(_loss(model, step), opt) as scaled:
            scaled.backward()
            next(model.parameters()).grad.view(-1)[0] = INF
    opt.step()
    H.assert_bitwise_equal(H.snapshot(model, opt), before)
    assert _amp_state.loss_scalers[0].loss_scale() == 2.0**14
    _train_step(model, opt, 5)
    assert not torch.equal(next(model.parameters()).float(), before["model"]["0.weight"].float())


@pytest.mark.parametrize("level, low", H.CONFIGS)
def test_static_scale_never_skips(level, low):
    model, opt = _model_opt(level, low, opt_cls=torch.optim.SGD, loss_scale=128.0)
    scaler = _amp_state.loss_scalers[0]
    _train_step(model, opt, 0, inject=True)
    assert scaler.loss_scale() == 128.0
    assert not torch.isfinite(next(model.parameters())).all()  # the step was applied (Apex semantics)


def test_delay_overflow_check_never_skips():
    model, opt = _model_opt("O2", torch.float16, opt_cls=torch.optim.SGD)
    _train_step(model, opt, 0, inject=True, delay_overflow_check=True)
    assert _amp_state.loss_scalers[0].loss_scale() == 2.0**16
    assert not torch.isfinite(next(model.parameters())).all()


# ------------------------------------------------------------------------------------------ growth, bounds
def test_growth_after_window(monkeypatch):
    model, opt = _model_opt("O2", torch.float16)
    scaler = _amp_state.loss_scalers[0]
    assert scaler.growth_interval == 2000  # Apex's window
    monkeypatch.setattr(scaler, "growth_interval", 3)
    for step in range(3):
        _train_step(model, opt, step)
    assert scaler.loss_scale() == 2.0**17 and scaler._unskipped == 0
    for step in range(2):
        _train_step(model, opt, step)
    assert scaler.loss_scale() == 2.0**17 and scaler._unskipped == 2


def test_growth_after_2000_clean_steps():
    model, opt = _model_opt("O1", torch.float16)
    scaler = _amp_state.loss_scalers[0]
    scaler._unskipped = 1998
    _train_step(model, opt, 0)
    assert scaler.loss_scale() == 2.0**16 and scaler._unskipped == 1999
    _train_step(model, opt, 1)
    assert scaler.loss_scale() == 2.0**17 and scaler._unskipped == 0


def test_min_loss_scale_floor():
    model, opt = _model_opt("O2", torch.float16, min_loss_scale=2.0**14)
    scaler = _amp_state.loss_scalers[0]
    scales = []
    for step in range(4):
        _train_step(model, opt, step, inject=True)
        scales.append(scaler.loss_scale())
    assert scales == [2.0**15, 2.0**14, 2.0**14, 2.0**14]


def test_max_loss_scale_cap(monkeypatch):
    model, opt = _model_opt("O2", torch.float16, max_loss_scale=2.0**17)
    scaler = _amp_state.loss_scalers[0]
    monkeypatch.setattr(scaler, "growth_interval", 1)
    scales = []
    for step in range(3):
        _train_step(model, opt, step)
        scales.append(scaler.loss_scale())
    assert scales == [2.0**17, 2.0**17, 2.0**17]



def test_apex_private_settings_set_by_scripts_take_effect():
    """Apex's LossScaler keeps its window and bounds in ``_scale_seq_len``, ``_min_loss_scale`` and
    ``_max_loss_scale``, which scripts set directly: the same settings as the public names."""
    model, opt = _model_opt("O2", torch.float16)
    scaler = _amp_state.loss_scalers[0]
    assert (scaler._scale_seq_len, scaler._min_loss_scale, scaler._max_loss_scale) == (
        2000, 0.0, 2.0**24)
    scaler._scale_seq_len, scaler._max_loss_scale = 1, 2.0**17
    scales = []
    for step in range(3):
        _train_step(model, opt, step)
        scales.append(scaler.loss_scale())
    assert scales == [2.0**17, 2.0**17, 2.0**17]  # grown after one clean step, then capped
    scaler._min_loss_scale = 2.0**16
    for step in range(3):
        _train_step(model, opt, step, inject=True)
    assert scaler.loss_scale() == 2.0**16 and scaler.min_loss_scale == 2.0**16

def test_max_loss_scale_caps_initial_scale():
    _model_opt("O1", torch.float16, max_loss_scale=2.0**10)
    assert _amp_state.loss_scalers[0].loss_scale() == 2.0**10


# ------------------------------------------------------------------------------------------ unscaling
@pytest.mark.parametrize("low", H.DTYPES.values(), ids=H.DTYPES.keys())
def test_o2_master_grads_equal_reference(low):
    """Master grads = grads of a hand-cast low-precision copy of the model (BN fp32), backpropagated
    from the same scaled loss by plain torch and divided by the scale in fp32."""
    model = H.make_cnn()
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            m.to(low)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", cast_model_type=low, loss_scale=1024.0, verbosity=0)
    x, y = H.batch(0, n=8, shape=(3, 6, 6))
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    (nn.functional.cross_entropy(ref(x.to(low)).float(), y) * 1024.0).backward()
    masters = list(amp.master_params(opt))
    for (name, r), m in zip(ref.named_parameters(), masters):
        assert m.dtype == torch.float32
        assert torch.equal(m.grad, r.grad.float() / 1024.0), name


def _grads(model, opt, level):
    params = amp.master_params(opt) if level == "O2" else model.parameters()
    return [p.grad.float().clone() for p in params]


@pytest.mark.parametrize("scale", ["default", "dynamic"])
@pytest.mark.parametrize("delay", [True, False], ids=["delay_unscale", "no_delay"])
@pytest.mark.parametrize("level, low", H.CONFIGS)
def test_accumulation_equals_sum(level, low, delay, scale):
    """Three backward passes, one step.  The reference is plain torch backward through a copy of the
    amp model (same casts, no amp bookkeeping), from the same scaled losses, with the accumulation
    rule written out: delay_unscale sums the scaled grads in the grad dtype and divides once; otherwise
    each pass is divided by S and added, in fp32, to the running sum (rounded to the grad dtype)."""
    kwargs = {} if scale == "default" else {"loss_scale": "dynamic"}
    model, opt = _model_opt(level, low, opt_cls=torch.optim.SGD, **kwargs)
    ref = copy.deepcopy(model)
    S = _amp_state.loss_scalers[0].loss_scale()
    n = 3
    opt.zero_grad()
    for step in range(n):
        with amp.scale_loss(_loss(model, step), opt, delay_unscale=delay and step < n - 1) as scaled:
            scaled.backward()
    ours = _grads(model, opt, level)

    acc_dtypes = [torch.float32 if level == "O2" else p.dtype for p in ref.parameters()]
    if delay:
        for step in range(n):
            (_loss(ref, step) * S).backward()  # torch accumulates in the grad dtype
        expected = [(p.grad.float() / S).to(d) for p, d in zip(ref.parameters(), acc_dtypes)]
    else:
        expected = [None] * len(acc_dtypes)
        for step in range(n):
            ref.zero_grad()
            (_loss(ref, step) * S).backward()
            expected = [(p.grad.float() / S + (0 if e is None else e.float())).to(d)
                        for p, e, d in zip(ref.parameters(), expected, acc_dtypes)]
    for i, (a, b) in enumerate(zip(ours, expected)):
        assert torch.equal(a, b.float()), f"param {i}: max diff {(a - b.float()).abs().max().item()}"


@pytest.mark.parametrize("opt_name", ["SGD", "FusedSGD"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_step_after_a_delayed_exit_is_refused_before_anything_changes(level, opt_name):
    """delay_unscale=True leaves the gradients scaled and unchecked: a step() then would apply
    them S times too large (Apex's did, silently). peak refuses it, changing nothing; the next
    non-delayed exit unscales everything accumulated and the step is the right one."""
    from peak.optimizers import FusedSGD

    opt_cls = FusedSGD if opt_name == "FusedSGD" else torch.optim.SGD
    model, ref_model = H.make_cnn(), H.make_cnn()
    opt, ref_opt = (opt_cls(m.parameters(), lr=1e-2) for m in (model, ref_model))
    H.init([model, ref_model], [opt, ref_opt], level, torch.float16, loss_scale=1024.0)
    for m, o in ((model, opt), (ref_model, ref_opt)):
        o.zero_grad()
        with amp.scale_loss(_loss(m, 0), o, delay_unscale=True) as scaled:
            scaled.backward()
    before = H.snapshot(model, opt)
    with pytest.raises(RuntimeError, match="still scaled and unchecked.*delay_unscale=True"):
        opt.step()
    H.assert_bitwise_equal(H.snapshot(model, opt), before)
    for m, o in ((model, opt), (ref_model, ref_opt)):
        with amp.scale_loss(_loss(m, 1), o) as scaled:
            scaled.backward()
        o.step()
    H.assert_bitwise_equal(H.snapshot(model, opt), H.snapshot(ref_model, ref_opt))


@pytest.mark.parametrize("opt_name", ["SGD", "FusedSGD"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_delayed_exit_then_another_losss_exit_unscales_each_by_its_own_scale(level, opt_name):
    """Gradient accumulation over two losses with their own scalers (the GAN recipe):
    delay_unscale under loss 0 (scale 2**16), then loss 1's exit (scale 2**10) unscales the
    sum: each part by its own scale, bit for bit as when both passes use loss 1's scaler."""
    from collections import OrderedDict

    from peak.optimizers import FusedSGD

    opt_cls = FusedSGD if opt_name == "FusedSGD" else torch.optim.SGD
    model, ref_model = H.make_cnn(), H.make_cnn()
    opt, ref_opt = (opt_cls(m.parameters(), lr=1e-2) for m in (model, ref_model))
    H.init([model, ref_model], [opt, ref_opt], level, torch.bfloat16, num_losses=2,
           loss_scale="dynamic")
    amp.load_state_dict(OrderedDict(loss_scaler0=OrderedDict(loss_scale=2.0**16, unskipped=0),
                                    loss_scaler1=OrderedDict(loss_scale=2.0**10, unskipped=0)))
    for m, o, first_id in ((model, opt, 0), (ref_model, ref_opt, 1)):
        o.zero_grad()
        with amp.scale_loss(_loss(m, 0), o, loss_id=first_id, delay_unscale=True) as scaled:
            scaled.backward()
        with amp.scale_loss(_loss(m, 1), o, loss_id=1) as scaled:
            scaled.backward()
        o.step()
    H.assert_bitwise_equal(H.snapshot(model, opt), H.snapshot(ref_model, ref_opt))
    assert [s.loss_scale() for s in _amp_state.loss_scalers] == [2.0**16, 2.0**10]


def _dyadic_linear(seed: int) -> nn.Linear:
    """Weights k/8 and inputs -3..3: gradients, scales and an SGD step of lr 2**-4 are exact
    in bf16 and fp32, so a run compares with float64 autograd bit for bit."""
    model = nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.randint(-4, 5, (3, 4), generator=torch.Generator().manual_seed(
            seed)).float() / 8)
    return model


def _dyadic_loss(model, k: int, dtype=torch.float32):
    x = torch.randint(-3, 4, (5, 4), generator=torch.Generator().manual_seed(100 + k)).float()
    return (model(x.to(dtype)).float() * (k + 1)).sum()


def _stepped(opt):
    from peak.optimizers import FusedOptimizer

    return [(opt.master_of(p) if isinstance(opt, FusedOptimizer) else p).detach().double()
            for g in opt.param_groups for p in g["params"]]


@pytest.mark.parametrize("level, opt_name, case", [  # (a frozen parameter is set aside: O2)
    (level, opt, case) for level, opt in (("O1", "SGD"), ("O2", "SGD"), ("O2", "FusedSGD"))
    for case in ("scale_grew_in_between", "normal_delayed_normal", "unfrozen_after_initialize")
    if level == "O2" or case != "unfrozen_after_initialize"])
def test_accumulated_passes_are_each_unscaled_by_their_own_scale(level, opt_name, case):
    """Passes of one step under several scales sum exactly as float64 autograd does: a delayed
    pass whose scaler another optimizer's exit grew before this one's final exit; a delayed
    pass (another loss) between two normal ones; a parameter frozen at initialize, unfrozen."""
    from collections import OrderedDict

    from peak.optimizers import FusedSGD

    make = {"SGD": torch.optim.SGD, "FusedSGD": FusedSGD}[opt_name]
    model, other = _dyadic_linear(0), _dyadic_linear(1)
    ref = copy.deepcopy(model).double()
    opt, other_opt = make(model.parameters(), lr=2**-4), torch.optim.SGD(other.parameters(), lr=1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=2**-4)
    if case == "unfrozen_after_initialize":
        model.weight.requires_grad_(False)
    (model, other), (opt, other_opt) = H.init([model, other], [opt, other_opt], level,
                                              torch.bfloat16, num_losses=2, loss_scale="dynamic")
    model.weight.requires_grad_(True)
    amp.load_state_dict(OrderedDict(loss_scaler0=OrderedDict(loss_scale=2.0**10, unskipped=1999),
                                    loss_scaler1=OrderedDict(loss_scale=2.0**16, unskipped=0)))
    passes = {"scale_grew_in_between": [(0, True), (0, False)],
              "normal_delayed_normal": [(0, False), (1, True), (0, False)],
              "unfrozen_after_initialize": [(1, True), (0, False)]}[case]
    low = torch.float32 if level == "O1" else torch.bfloat16
    for k, (loss_id, delay) in enumerate(passes):
        with amp.scale_loss(_dyadic_loss(model, k, low), opt, loss_id=loss_id,
                            delay_unscale=delay) as scaled:
            scaled.backward()
        _dyadic_loss(ref, k, torch.float64).backward()
        if case == "scale_grew_in_between" and k == 0:  # (a clean exit at the growth interval)
            with amp.scale_loss(_dyadic_loss(other, 9, low), other_opt) as scaled:
                scaled.backward()
            assert _amp_state.loss_scalers[0].loss_scale() == 2.0**11
    opt.step()
    ref_opt.step()
    assert torch.equal(_stepped(opt)[0], ref.weight.detach())


def test_scale_loss_blocks_do_not_nest_and_loss_id_is_an_index():
    """A block inside another would have the outer exit unscale the inner's gradients again:
    refused, and the outer block's gradients are put back; a numpy integer is a loss_id."""
    import numpy as np

    model, ref_model = H.make_cnn(), H.make_cnn()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=1e-2) for m in (model, ref_model))
    H.init([model, ref_model], [opt, ref_opt], "O2", torch.bfloat16, num_losses=2)
    with pytest.raises(RuntimeError, match="do not nest"):
        with amp.scale_loss(_loss(model, 0), opt) as outer:
            with amp.scale_loss(_loss(model, 1), opt, loss_id=1) as inner:
                inner.backward()
            outer.backward()
    with pytest.raises(IndexError, match=r"created loss scalers 0..1; .*\(loss_id: an int\)"):
        with amp.scale_loss(_loss(model, 0), opt, loss_id=1.0):
            pass
    for m, o in ((model, opt), (ref_model, ref_opt)):
        with amp.scale_loss(_loss(m, 0), o, loss_id=np.int64(1)) as scaled:
            scaled.backward()
        o.step()
    H.assert_bitwise_equal(H.snapshot(model, opt), H.snapshot(ref_model, ref_opt))
    model = H.make_cnn()  # disabled amp passes losses through, nested or not (as Apex)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, enabled=False)
    with amp.scale_loss(_loss(model, 0), opt) as outer, amp.scale_loss(_loss(model, 1), opt) as inner:
        (outer + inner).backward()


def test_tuple_of_optimizers_is_not_unscaled_twice():
    grads = []
    for container in (list, tuple):
        model, opt = _model_opt("O1", torch.float16, opt_cls=torch.optim.SGD)
        opt.zero_grad()
        for step in range(2):
            with amp.scale_loss(_loss(model, step), container([opt])) as scaled:
                scaled.backward()
        grads.append(_grads(model, opt, "O1"))
    H.assert_bitwise_equal(grads[0], grads[1])


# ------------------------------------------------------------------------------------------ several of each
def _two_model_setup(level, low, reference=False):
    m0, m1 = H.make_mlp(1), H.make_mlp(2)
    o0 = torch.optim.SGD(m0.parameters(), lr=0.1, momentum=0.9)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.05, momentum=0.9)
    if not reference:
        H.init([m0, m1], [o0, o1], level, low, num_losses=2, loss_scale="dynamic")
    return m0, m1, o0, o1


def _two_model_run(level, low, inject, reference=False):
    """Two models, two optimizers, two losses; loss 1 spans both optimizers.  ``inject`` maps
    iteration -> loss id whose backward gets an inf.  The reference run is plain fp32 torch that skips
    the steps amp should skip."""
    m0, m1, o0, o1 = _two_model_setup(level, low, reference)
    for it in range(5):
        x, y = H.batch(it, n=8, shape=(6,))
        o0.zero_grad()
        o1.zero_grad()
        loss0 = nn.functional.cross_entropy(m0(x).float(), y)
        loss1 = nn.functional.mse_loss(m0(x).float(), m1(x).float())
        for loss_id, loss, opts in ((0, loss0, [o0]), (1, loss1, [o0, o1])):
            if reference:
                loss.backward()
            else:
                with amp.scale_loss(loss, opts, loss_id=loss_id) as scaled:
                    scaled.backward()
                    if inject.get(it) == loss_id:
                        model = m0 if loss_id == 0 else m1
                        next(model.parameters()).grad.view(-1)[0] = INF
        skip = {0: [o0], 1: [o0, o1]}.get(inject.get(it), [])
        for opt in (o0, o1):
            if reference and any(opt is s for s in skip):
                continue
            opt.step()
    return m0, m1


@pytest.mark.parametrize("level, low", H.CONFIGS)
def test_multiple_models_optimizers_losses(level, low, capsys):
    inject = {1: 0, 3: 1}  # iteration 1: loss 0 overflows (skips o0); iteration 3: loss 1 (skips o0 and o1)
    m0, m1 = _two_model_run(level, low, inject)
    s0, s1 = _amp_state.loss_scalers
    assert s0.loss_scale() == 2.0**15 and s1.loss_scale() == 2.0**15  # each halved exactly once
    out = capsys.readouterr().out  # verbosity 0 in these runs
    assert out == ""
    r0, r1 = _two_model_run(level, low, inject, reference=True)
    for a, b in zip(list(m0.parameters()) + list(m1.parameters()), list(r0.parameters()) + list(r1.parameters())):
        if level == "O0":
            assert torch.equal(a, b)  # fp32 with power-of-two scaling: bit-for-bit plain torch
        else:
            tol = 0.05 if low == torch.bfloat16 else 0.01
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
