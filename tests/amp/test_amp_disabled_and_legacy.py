"""enabled=False behaves exactly like the fp32 script; the deprecated amp.init() handle still works."""
import pytest
import torch
from torch import nn

from peak import amp
from peak.amp._amp_state import _amp_state

import amp_helpers as H


def _train(use_amp, steps=4):
    model = H.make_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if use_amp:
        returned = amp.initialize(model, opt, enabled=False, opt_level="O2")
        assert returned[0] is model and returned[1] is opt
        assert "forward" not in model.__dict__ and not hasattr(opt, "_amp_stash")
    for step in range(steps):
        x, y = H.batch(step, n=8, shape=(3, 6, 6))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        if use_amp:
            with amp.scale_loss(loss, opt) as scaled:
                assert scaled is loss
                scaled.backward()
            nn.utils.clip_grad_norm_(amp.master_params(opt), 10.0)
            amp.load_state_dict(amp.state_dict())
        else:
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
    return model, opt


def test_enabled_false_equals_plain_fp32_training():
    ours_model, ours_opt = _train(True)
    ref_model, ref_opt = _train(False)
    H.assert_bitwise_equal(H.snapshot(ours_model, ours_opt), H.snapshot(ref_model, ref_opt))
    H.assert_bitwise_equal(ours_model.state_dict(), ref_model.state_dict())


def test_enabled_false_accepts_anything_and_returns_as_passed():
    model = H.make_mlp()
    assert amp.initialize(model, enabled=False, opt_level="bogus") is model
    models = [H.make_mlp(1), H.make_mlp(2)]
    out_models, out_opts = amp.initialize(models, [], enabled=False)
    assert out_models is models and out_opts == []
    assert amp.state_dict() == {}


# ------------------------------------------------------------------------------------------ legacy
def test_init_handle_scales_unscales_and_skips():
    with pytest.warns(DeprecationWarning, match="amp.initialize"):
        handle = amp.init(verbose=False)
    model = H.make_mlp()
    ref = H.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x, y = H.batch(step, n=8, shape=(6,))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with handle.scale_loss(loss, opt) as scaled:
            assert torch.equal(scaled, loss * 65536.0)
            scaled.backward()
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        for a, b in zip(model.parameters(), ref.parameters()):
            assert torch.equal(a.grad, b.grad)  # unscaled exactly (power-of-two scale, fp32 model)
        opt.step()
        ref_opt.step()
    before = H.snapshot(model, opt)
    x, y = H.batch(9, n=8, shape=(6,))
    with handle.scale_loss(nn.functional.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
        model[0].weight.grad[0, 0] = float("inf")
    opt.step()
    H.assert_bitwise_equal(H.snapshot(model, opt), before)
    assert _amp_state.loss_scalers[0].loss_scale() == 2.0**15


def test_init_disabled_returns_noop_handle():
    with pytest.warns(DeprecationWarning):
        handle = amp.init(enabled=False)
    loss = torch.ones((), requires_grad=True)
    with handle.scale_loss(loss, None) as scaled:
        assert scaled is loss
    assert not handle.is_active()


@pytest.mark.parametrize("enabled", [True, False])
def test_init_wrap_optimizer_points_to_new_api(enabled):
    """Enabled or not (a script's fp32 branch: the disabled handle returned the bare optimizer,
    whose missing scale_loss raised an AttributeError)."""
    with pytest.warns(DeprecationWarning):
        handle = amp.init(enabled=enabled)
    with pytest.raises(NotImplementedError, match="num_losses=N"):
        handle.wrap_optimizer(torch.optim.SGD(H.make_mlp().parameters(), lr=0.1), num_loss=2)


def test_o1_handle_deactivate():
    model = H.make_mlp()
    amp.initialize(model, opt_level="O1", verbosity=0)
    assert _amp_state.handle.is_active()
    assert model(torch.randn(2, 6)).dtype == torch.float16
    _amp_state.handle._deactivate()
    assert model(torch.randn(2, 6)).dtype == torch.float32
