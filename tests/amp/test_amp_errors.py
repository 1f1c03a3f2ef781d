"""Bad input: every error says what to do, and nothing is left half-patched."""
import copy
import warnings

import pytest
import torch
from torch import nn

from peak import amp
from peak.amp import _caster
from peak.amp._amp_state import _amp_state
from peak.optimizers import FusedSGD

import amp_helpers as H


def _pair(seed=0):
    model = H.make_mlp(seed)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _untouched(model, opt=None):
    assert "forward" not in model.__dict__
    assert all(p.dtype == torch.float32 for p in model.parameters())
    if opt is not None:
        assert not hasattr(opt, "_amp_stash") and "step" not in opt.__dict__


def _backward_step(model, opt, loss_id=0):
    x, y = H.batch(0, n=4, shape=(6,))
    opt.zero_grad()
    with amp.scale_loss(nn.functional.cross_entropy(model(x).float(), y), opt, loss_id=loss_id) as scaled:
        scaled.backward()
    opt.step()


def test_scale_loss_before_initialize():
    model, opt = _pair()
    with pytest.raises(RuntimeError, match="must be called before `with amp.scale_loss`"):
        with amp.scale_loss(torch.ones((), requires_grad=True), opt):
            pass


def test_state_dict_before_initialize():
    with pytest.raises(RuntimeError, match="call model, optimizer = amp.initialize"):
        amp.state_dict()
    with pytest.raises(RuntimeError, match="before amp.initialize"):
        amp.load_state_dict({})


def test_same_model_twice():
    model, opt = _pair()
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    fresh_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="already passed through amp.initialize.*build a fresh model"):
        amp.initialize(model, fresh_opt, opt_level="O2", verbosity=0)
    assert not hasattr(fresh_opt, "_amp_stash")
    _backward_step(model, opt)  # the first initialize's state is intact


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_a_copy_of_an_initialized_model_is_refused_and_usable_as_it_is(level):
    """A deepcopy (an EMA) keeps the cast parameters and the patched forward: initializing it
    again wrapped the forward twice (O0/O1: unbounded recursion at its first call) or blamed
    .half() (O2/O3)."""
    model, opt = _pair()
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    ema = copy.deepcopy(model)
    with pytest.raises(RuntimeError, match="or copied from one.*copy the model before amp"):
        amp.initialize(ema, opt_level=level, verbosity=0)
    x = torch.randn(3, 6)
    assert torch.equal(ema(x), model(x))  # the same weights, cast and fed alike
    with torch.no_grad():
        next(ema.parameters()).mul_(2)
    assert not torch.equal(ema(x), model(x))  # and its forward runs its own weights
    _backward_step(model, opt)


def test_same_optimizer_twice():
    model, opt = _pair()
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    new_model = H.make_mlp(1)
    with pytest.raises(RuntimeError, match="should only be passed through amp.initialize once.*fresh optimizer"):
        amp.initialize(new_model, opt, opt_level="O2", verbosity=0)
    _untouched(new_model)  # the new model was not cast although it came first
    _backward_step(model, opt)


def test_same_object_twice_in_one_call():
    model, opt = _pair()
    with pytest.raises(ValueError, match=r"models\[1\] is the same object as models\[0\]"):
        amp.initialize([model, model], opt, verbosity=0)
    with pytest.raises(ValueError, match=r"optimizers\[1\] is the same object as optimizers\[0\]"):
        amp.initialize(model, [opt, opt], verbosity=0)
    _untouched(model, opt)


@pytest.mark.parametrize("low", H.DTYPES.values(), ids=H.DTYPES.keys())
def test_model_already_low_precision(low):
    model = H.make_mlp().to(low)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=f"Found param 0.weight with type {low}, expected torch.float32(.|\n)*"
                                           "do not need to call .half"):
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert not hasattr(opt, "_amp_stash") and "forward" not in model.__dict__
    _amp_state.allow_incoming_model_not_fp32 = True  # the documented escape hatch
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert all(m.dtype == torch.float32 for m in amp.master_params(opt))


def test_low_precision_buffer_is_reported():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model[1].running_mean = model[1].running_mean.half()
    with pytest.raises(RuntimeError, match="Found buffer 1.running_mean"):
        amp.initialize(model, opt_level="O1", verbosity=0)


def test_optimizer_params_not_the_models():
    model, _ = _pair()
    other = H.make_mlp(1)
    opt = torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizers\[0\] \(SGD\), param_groups\[0\], holds a parameter of shape "
                                         r"\(8, 6\) that is not a parameter of any model.*amp.initialize\(\[model_a"):
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
    _untouched(model, opt)
    _untouched(other)
    amp.initialize([model, other], opt, opt_level="O2", verbosity=0)  # passing both models works


def _shared_weight_step(opt_level, make_opts):
    """The weight's move after one step of optimizers that share it (fp32 without opt_level)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    w0 = model.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation of a group holding one twice
        opts = make_opts(model.weight)
    if opt_level is not None:
        model, opts = amp.initialize(model, opts, opt_level=opt_level,
                                     low_precision_dtype=torch.bfloat16, verbosity=0)
        with amp.scale_loss(model(torch.ones(2, 4)).float().sum(), opts) as scaled:
            scaled.backward()
    else:
        model(torch.ones(2, 4)).sum().backward()
    for opt in opts:
        opt.step()
    return (w0 - model.weight.detach().float())[0, 0].item()


@pytest.mark.parametrize("make_opts", [
    lambda w: [torch.optim.SGD([w, w], lr=0.1)],
    lambda w: [torch.optim.SGD([w], lr=0.1), torch.optim.SGD([w], lr=0.1)],
    lambda w: [FusedSGD([w], lr=0.1), torch.optim.SGD([w], lr=0.1)],
    lambda w: [FusedSGD([w], lr=0.1), FusedSGD([w], lr=0.1)],
], ids=["twice in a group", "two torch optimizers", "fused and torch", "two fused"])
def test_a_parameter_held_twice_under_master_weights_is_refused(make_opts):
    """Under O2 each optimizer (a torch one: each entry) steps its own fp32 master of a parameter
    and only one reached the model: half the update of fp32 training, silently (two fused
    optimizers from their second step on). O1 steps it as torch does."""
    reference = _shared_weight_step(None, make_opts)  # fp32 torch: every entry steps it
    assert reference == pytest.approx(0.4)
    assert _shared_weight_step("O1", make_opts) == pytest.approx(reference, rel=1e-2)
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opts = make_opts(model.weight)
    with pytest.raises(ValueError, match=r"held more than once \(by optimizers\[0\] and "
                                         r"optimizers\[[01]\]\).*one optimizer, once"):
        amp.initialize(model, opts, opt_level="O2", verbosity=0)
    _untouched(model)
    for opt in opts:
        assert not hasattr(opt, "_amp_stash") and "step" not in opt.__dict__


@pytest.mark.parametrize("opt_level, low", [("O2", torch.bfloat16), ("O2", torch.float16),
                                            ("O1", torch.float16)])
def test_a_parameter_held_twice_is_refused_wherever_amp_unscales_per_holder(opt_level, low):
    """Frozen parameters (masters made when unfrozen) and O2's fp32 batch norm (its gradient
    unscaled in place by each holder: 1/scale of the update, or 0 with a dynamic scale) held by
    two optimizers; under O1 with fp16's dynamic scale any shared parameter (the weight did not
    move). O1 with bf16 (a static scale of 1) steps them as torch does."""
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        model[0].weight.requires_grad_(False)
        shared = [model[0].weight, *model[1].parameters()]
        return model, shared, [torch.optim.SGD(shared + list(model[2].parameters()), lr=0.1),
                               torch.optim.SGD(shared + [model[0].bias], lr=0.1)]

    model, shared, opts = make()
    with pytest.raises(ValueError, match=r"held more than once \(by optimizers\[0\] and "
                                         r"optimizers\[1\]\)"):
        amp.initialize(model, opts, opt_level=opt_level, low_precision_dtype=low, verbosity=0)
    _untouched(model)
    if opt_level == "O1":  # the same with bf16: no unscaling, torch's two updates
        model, shared, opts = make()
        reference = copy.deepcopy(model)
        ref_shared = [reference[0].weight, *reference[1].parameters()]
        ref_opts = [torch.optim.SGD(ref_shared + list(reference[2].parameters()), lr=0.1),
                    torch.optim.SGD(ref_shared + [reference[0].bias], lr=0.1)]
        model, opts = amp.initialize(model, opts, opt_level="O1",
                                     low_precision_dtype=torch.bfloat16, verbosity=0)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        with amp.scale_loss(model(x).float().sum(), opts) as scaled:
            scaled.backward()
        reference(x).sum().backward()
        for opt in opts + ref_opts:
            opt.step()
        for got, want in zip(shared, ref_shared):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # (bf16 products)


def test_a_verbosity_or_amp_state_of_the_wrong_type_is_named():
    """Both failed on a comparison or a method deep inside (a bare TypeError/AttributeError)."""
    model, opt = _pair()
    with pytest.raises(TypeError, match=r"verbosity must be a number.*verbosity='1'"):
        amp.initialize(model, opt, opt_level="O2", verbosity="1")
    _untouched(model, opt)
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    saved = amp.state_dict()
    for bad in ([saved], None):
        with pytest.raises(TypeError, match=r"amp.load_state_dict takes the dict amp.state_dict\(\) "
                                            r"returned, got (list|NoneType)"):
            amp.load_state_dict(bad)
    assert amp.state_dict() == saved


def test_non_scalar_and_non_tensor_loss():
    model, opt = _pair()
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    out = model(torch.randn(4, 6))
    for p in model.parameters():  # gradients of an earlier pass, which a bad loss must not touch
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"loss must be a scalar.*shape \(4, 3\).*loss.mean\(\)"):
        with amp.scale_loss(out, opt):
            pass
    with pytest.raises(TypeError, match="loss must be a torch.Tensor, got float"):
        with amp.scale_loss(1.0, opt):
            pass
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())


@pytest.mark.parametrize("loss_id", [1, 5, -1])
def test_loss_id_out_of_range(loss_id):
    model, opt = _pair()
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with pytest.raises(IndexError, match=r"num_losses=1\) created loss scalers 0..0; pass num_losses="):
        _backward_step(model, opt, loss_id=loss_id)


@pytest.mark.parametrize("loss_id", ["0", 0.0, True])
def test_loss_id_not_an_int(loss_id):
    model, opt = _pair()
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    with pytest.raises(IndexError, match=r"created loss scalers 0..0; .*\(loss_id: an int\)"):
        _backward_step(model, opt, loss_id=loss_id)


def test_optimizer_not_initialized_or_stale():
    model, opt = _pair()
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    stray = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="was not passed through amp.initialize; pass it"):
        _backward_step(model, stray)
    new_model, new_opt = _pair(1)
    amp.initialize(new_model, new_opt, opt_level="O2", verbosity=0)
    with pytest.raises(RuntimeError, match="earlier amp.initialize call.*latest amp.initialize"):
        _backward_step(model, opt)


def test_bad_models_and_optimizers_types():
    model, opt = _pair()
    with pytest.raises(TypeError, match="models must be either a single model or a list of models"):
        amp.initialize((model,), opt, verbosity=0)
    with pytest.raises(TypeError, match="optimizers must be either a single optimizer or a list.*pass a list"):
        amp.initialize(model, (opt,), verbosity=0)
    with pytest.raises(RuntimeError, match="Parallel wrappers should only be applied to the model"):
        amp.initialize(nn.DataParallel(model), opt, verbosity=0)
    _untouched(model, opt)


def test_reinitialize_with_new_objects_replaces_state():
    # first run: O1, overflow halves the scale
    model, opt = _pair()
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    x, y = H.batch(0, n=4, shape=(6,))
    with amp.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
        model[0].weight.grad[0, 0] = float("inf")
    assert _amp_state.loss_scalers[0].loss_scale() == 2.0**15
    assert model(x).dtype == torch.float16 and _caster.low_dtype() == torch.float16
    # the cell is re-run with new objects and another opt_level
    model2, opt2 = _pair()
    amp.initialize(model2, opt2, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0)
    assert _amp_state.opt_properties.opt_level == "O2"
    assert _caster.low_dtype() is None  # O1 casting is off
    assert model(x).dtype == torch.float32  # the old O1 model no longer autocasts
    assert len(_amp_state.loss_scalers) == 1 and _amp_state.loss_scalers[0].loss_scale() == 1.0
    _backward_step(model2, opt2)
    assert model2[0].weight.dtype == torch.bfloat16


def test_enabled_false_after_enabled_run_clears_state():
    model, opt = _pair()
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    model2, opt2 = _pair(1)
    amp.initialize(model2, opt2, enabled=False)
    assert _caster.low_dtype() is None and _amp_state.loss_scalers == []
    assert amp.state_dict() == {}


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_failed_backward_restores_earlier_gradients(level):
    model, opt = _pair()
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    x, y = H.batch(0, n=4, shape=(6,))
    opt.zero_grad()
    with amp.scale_loss(nn.functional.cross_entropy(model(x).float(), y), opt) as scaled:
        scaled.backward()
    before = [None if p.grad is None else p.grad.clone() for p in amp.master_params(opt)]
    with pytest.raises(RuntimeError, match="boom"):
        with amp.scale_loss(nn.functional.cross_entropy(model(x).float(), y), opt):
            raise RuntimeError("boom")
    after = [p.grad for p in amp.master_params(opt)]
    H.assert_bitwise_equal(after, before)


def test_same_optimizer_twice_in_scale_loss_counts_once():
    grads = []
    for opts in (lambda o: o, lambda o: [o, o]):
        model, opt = _pair()
        amp.initialize(model, opt, opt_level="O1", verbosity=0)
        x, y = H.batch(0, n=4, shape=(6,))
        opt.zero_grad()
        for _ in range(2):
            with amp.scale_loss(nn.functional.cross_entropy(model(x).float(), y), opts(opt)) as scaled:
                scaled.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    H.assert_bitwise_equal(grads[0], grads[1])


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_backward_that_reaches_no_parameter_warns_once(level):
    """A step that would change nothing (the optimizer holds parameters the backward did not
    reach, e.g. replaced by FSDP2's fully_shard after initialize) is said, once."""
    model, opt = _pair()
    amp.initialize(model, opt, opt_level=level, verbosity=0)
    free = torch.ones((), requires_grad=True)
    with pytest.warns(UserWarning, match="gave none of the optimizer's parameters a gradient") as w:
        with amp.scale_loss(free * 2, opt) as scaled:
            scaled.backward()
    assert w[0].filename == __file__  # it points at the script's `with amp.scale_loss` line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with amp.scale_loss(free * 2, opt) as scaled:  # once
            scaled.backward()
        with amp.scale_loss(model(torch.randn(4, 6)).float().sum(), opt) as scaled:
            scaled.backward()
