"""amp O2 with a peak fused optimizer: the fused path (no unscale pass, no master->model copy)."""
import warnings

import pytest
import torch

from peak import amp, ops
from peak.optimizers import FusedAdam, FusedSGD
from peak_testing import (assert_bitwise_equal, assert_poisoned_steps_skipped, make_mlp,
                          snapshot)

torch.set_num_threads(1)


def batches(n=5):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


def amp_run(make_opt, dtype, data, **init_kw):
    model = make_mlp()
    opt = make_opt(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=dtype,
                                verbosity=0, **init_kw)
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    return model, opt


def by_hand(dtype, data, scale, **adam_kw):
    """FusedAdam used without amp: the same fp32 weights as masters, a low-precision model,
    loss * S, grad_scale=S."""
    ref = make_mlp()
    masters = [p.detach().clone() for p in ref.parameters()]
    ref = ref.to(dtype)
    ref_opt = FusedAdam(ref.parameters(), lr=1e-2, adam_w_mode=True, **adam_kw)
    for p, m in zip(ref.parameters(), masters):
        ref_opt.state[p]["master_param"] = m
    for x, y in data:
        ref_opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ref(x.to(dtype)).float(), y)
        (loss.float() * scale).backward()
        ref_opt.step(grad_scale=torch.tensor([scale]))
    return ref, ref_opt


@pytest.mark.parametrize("dtype,scale", [(torch.float16, 2.0 ** 16), (torch.bfloat16, 1.0)],
                         ids=["f16_dynamic", "bf16_static"])
def test_o2_fused_equals_the_optimizer_used_by_hand(dtype, scale):
    data = batches()
    model, opt = amp_run(lambda p: FusedAdam(p, lr=1e-2, adam_w_mode=True, weight_decay=0.1),
                         dtype, data)
    ref, ref_opt = by_hand(dtype, data, scale, weight_decay=0.1)
    for (p, q) in zip(model.parameters(), ref.parameters()):
        assert p.dtype == dtype
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["master_param"], ref_opt.state[q]["master_param"])


def test_no_unscale_or_copy_pass(monkeypatch):
    calls = []
    real = ops.multi_tensor_scale_
    monkeypatch.setattr(ops, "multi_tensor_scale_", lambda *a, **k: calls.append(1) or real(*a, **k))
    amp_run(lambda p: FusedSGD(p, lr=0.1, momentum=0.9), torch.float16, batches(3))
    assert calls == [], "the fused path unscales and writes the model inside the optimizer step"


@pytest.mark.parametrize("dtype,loss_scale", [(torch.bfloat16, None), (torch.float16, 128.0)],
                         ids=["bf16_static_1", "f16_static_128"])
def test_a_static_scale_makes_no_check_pass(monkeypatch, dtype, loss_scale):
    # A static scaler never reads the overflow flag (Apex): scale_loss's exit checks nothing. With
    # a scale of 1 the step gets no grad_scale either (unscaling by 1 and storing the gradient
    # back would change no bit); with 128 it unscales and stores back as usual.
    checks, steps = [], []
    real_check, real_step = ops.multi_tensor_check_finite_, ops.fused_adam_
    monkeypatch.setattr(ops, "multi_tensor_check_finite_",
                        lambda *a, **k: checks.append(1) or real_check(*a, **k))
    monkeypatch.setattr(ops, "fused_adam_", lambda *a, **k: steps.append(k) or real_step(*a, **k))
    kw = {} if loss_scale is None else {"loss_scale": loss_scale}
    data = batches(3)
    model, opt = amp_run(lambda p: FusedAdam(p, lr=1e-2, adam_w_mode=True), dtype, data, **kw)
    assert checks == []
    assert len(steps) == 3
    for k in steps:
        if loss_scale is None:
            assert k["grad_scale"] is None and not k["store_unscaled_grads"]
        else:
            assert float(k["grad_scale"]) == loss_scale and k["store_unscaled_grads"]
    # The weights are those of the step handed the scale by hand.
    ref, _ = by_hand(dtype, data, 1.0 if loss_scale is None else loss_scale)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)


def test_overflow_skips_bit_for_bit_and_backs_off():
    model = make_mlp()
    opt = FusedAdam(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    (x, y), = batches(1)

    def step(i, poison):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if poison:
            loss = loss * float("inf")
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()

    scaler = amp._amp_state.loss_scalers[0]
    assert_poisoned_steps_skipped(step, 2, {1}, lambda: snapshot(model, opt), scale=scaler.loss_scale)
    assert scaler.loss_scale() == 2.0 ** 15


def test_accumulating_two_passes_equals_one_pass_of_the_sum():
    data = batches(2)
    runs = []
    for split in (True, False):
        model = make_mlp()
        opt = FusedSGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        opt.zero_grad()
        losses = [torch.nn.functional.mse_loss(model(x), y) for x, y in data]
        for loss in (losses if split else [sum(losses)]):
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
        runs.append([opt.state[p]["master_param"].clone() for p in model.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)  # fp16 grads summed in fp16


def test_clipping_on_master_params_sees_unscaled_gradients():
    model = make_mlp()
    opt = FusedSGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    (x, y), = batches(1)
    loss = torch.nn.functional.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1e9)
    # the true (unscaled) gradient norm, from an fp32 copy of the same half model
    ref = make_mlp()
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    torch.nn.functional.mse_loss(ref(x.half().float()), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    torch.testing.assert_close(norm.float(), ref_norm, rtol=2e-2, atol=0)
    weights = [p.detach().float().clone() for p in model.parameters()]
    opt.step()
    assert any(not torch.equal(p.float(), w) for p, w in zip(model.parameters(), weights))



def _clip_model_norm(model, opt):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def _clip_model_value(model, opt):
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)


def _clip_model_then_read_masters(model, opt):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    list(amp.master_params(opt))


def _drop_a_grad(model, opt):  # changes that do not depend on the scale: no warning
    next(model.parameters()).grad = None


def _zero_a_row(model, opt):
    next(model.parameters()).grad[0] = 0


@pytest.mark.parametrize("change, warns", [
    (_clip_model_norm, True), (_clip_model_value, True), (_clip_model_then_read_masters, True),
    (_drop_a_grad, False), (_zero_a_row, True)])
@pytest.mark.parametrize("make_opt", [lambda p: FusedSGD(p, lr=0.1, momentum=0.9),
                                      lambda p: FusedAdam(p, lr=1e-2)], ids=["sgd", "adam"])
def test_scaled_gradients_changed_in_place_after_the_exit_are_warned_about(change, warns,
                                                                           make_opt):
    """O2 + fused, fp16 dynamic: the step reads the model's gradients still scaled, so a clip of
    model.parameters() (a no-op on Apex's masters) acts on scaled values: warned (any in-place
    change is, a scale-independent one as the zeroed row too); the step runs, as before."""
    model = make_mlp()
    model, opt = amp.initialize(model, make_opt(model.parameters()), opt_level="O2", verbosity=0)
    (x, y), = batches(1)
    with amp.scale_loss(torch.nn.functional.mse_loss(model(x), y), opt) as scaled:
        scaled.backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        change(model, opt)
        opt.step()
    said = [w for w in caught if "changed in place after amp.scale_loss" in str(w.message)]
    assert len(said) == int(warns)


def test_gradient_views_are_not_compared():
    """Views of one flat buffer (DDP's gradient_as_bucket_view) share its version counter: a
    change of one gradient would look like a change of all (another optimizer's too), so views
    are left out of the comparison."""
    model = make_mlp()
    opt_a = FusedAdam(list(model.parameters())[:2], lr=1e-2)
    opt_b = FusedAdam(list(model.parameters())[2:], lr=1e-2)
    model, (opt_a, opt_b) = amp.initialize(model, [opt_a, opt_b], opt_level="O2", verbosity=0)
    (x, y), = batches(1)
    with amp.scale_loss(torch.nn.functional.mse_loss(model(x), y), [opt_a, opt_b]) as scaled:
        scaled.backward()
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    offset = 0
    for p in model.parameters():  # each gradient a view of `flat`, with the same values
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        next(model.parameters()).grad[0] = 0  # opt_a's, in place: the buffer's counter moves
        opt_b.step()  # whose gradients did not change
    assert not [w for w in caught if "changed in place" in str(w.message)]


@pytest.mark.parametrize("cached", [True, False], ids=["list_taken_before", "read_each_step"])
def test_masters_listed_before_the_backward_have_no_gradients_and_the_step_says_so(cached):
    """O2 + fused: amp.master_params gives the masters fp32 gradients when it is called after the
    scale_loss block; a list taken before has none to clip, so the step warns (and only then)."""
    model = make_mlp()
    model, opt = amp.initialize(model, FusedSGD(model.parameters(), lr=0.1), opt_level="O2",
                                verbosity=0)
    listed = list(amp.master_params(opt)) if cached else None
    list(amp.master_params(opt))  # (read again without gradients: an EMA's read)
    said = []
    for x, y in batches(2):
        opt.zero_grad()
        with amp.scale_loss(torch.nn.functional.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        masters = listed if cached else list(amp.master_params(opt))
        assert all((m.grad is None) == cached for m in masters)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        said += [w for w in caught if "was read before this step's backward" in str(w.message)]
    assert len(said) == int(cached)  # once per optimizer

def test_unscaled_gradients_may_be_clipped_on_the_model():
    """bf16 with a static scale of 1: the gradients the step reads are unscaled, so clipping
    model.parameters() is a real clip (as clipping amp.master_params is), not refused."""
    (x, y), = batches(1)
    updates = []
    for clip_model in (True, False):
        model = make_mlp()
        model, opt = amp.initialize(model, FusedSGD(model.parameters(), lr=1.0), opt_level="O2",
                                    low_precision_dtype=torch.bfloat16, verbosity=0)
        with amp.scale_loss(torch.nn.functional.mse_loss(model(x), y) * 100, opt) as scaled:
            scaled.backward()
        masters = [m.detach().clone() for m in opt.master_params()]
        torch.nn.utils.clip_grad_norm_(model.parameters() if clip_model
                                       else amp.master_params(opt), 0.5)
        opt.step()
        updates.append(torch.cat([(m - w).flatten() for m, w in zip(opt.master_params(),
                                                                    masters)]))
    assert updates[0].norm() < 0.51  # clipped to 0.5 (the loss * 100 makes the norm larger)
    torch.testing.assert_close(updates[0], updates[1], rtol=2e-2, atol=1e-4)  # bf16 vs fp32 norm

def test_masters_checkpoint_through_the_optimizer_state():
    model, opt = amp_run(lambda p: FusedAdam(p, lr=1e-2), torch.bfloat16, batches(2))
    sd = opt.state_dict()
    masters = [st["master_param"] for st in sd["state"].values()]
    assert len(masters) == 4 and all(m.dtype == torch.float32 for m in masters)
    assert "amp_master_params" not in sd  # the fused optimizer saves its own masters
