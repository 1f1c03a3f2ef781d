"""peak.fp16_utils.FP16_Optimizer (Apex's deprecated wrapper)."""
import copy

import pytest
import torch

from peak.fp16_utils import FP16_Optimizer

from peak_testing import dtype_id


def model_and_data(dtype, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    fp32 = copy.deepcopy(model)
    return model.to(dtype), fp32, [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(6)]


def make(model, **kw):
    with pytest.warns(DeprecationWarning, match="amp.initialize"):
        return FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
def test_static_scale_steps_the_masters_like_fp32_sgd(dtype):
    """Masters follow torch SGD on fp32 copies fed the same unscaled gradients; the model holds
    the masters rounded once."""
    model, _, data = model_and_data(dtype)
    opt = make(model, static_loss_scale=128.0)
    masters_ref = [m.detach().clone().requires_grad_() for m in opt.master_params]
    ref = torch.optim.SGD(masters_ref, lr=0.1, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)
        opt.backward(loss)
        for r, p in zip(masters_ref, opt.model_params):
            r.grad = (p.grad.float() / 128.0)
        opt.step()
        ref.step()
    for m, r, p in zip(opt.master_params, masters_ref, opt.model_params):
        assert torch.equal(m, r)
        assert torch.equal(p.detach(), m.detach().to(dtype))


def test_dynamic_overflow_skips_and_halves():
    model, _, data = model_and_data(torch.float16)
    opt = make(model, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 1024.0},
               verbose=False)
    x, y = data[0]
    opt.zero_grad()
    opt.backward(torch.nn.functional.mse_loss(model(x.half()).float(), y))
    opt.step()
    before = [p.detach().clone() for p in opt.model_params]
    masters = [m.detach().clone() for m in opt.master_params]
    state = copy.deepcopy(opt.optimizer.state_dict()["state"])
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x.half()).float(), y) * float("inf")
    opt.backward(loss)
    assert opt.overflow
    opt.step()
    assert opt.loss_scale == 512.0
    for a, b in zip(opt.model_params, before):
        assert torch.equal(a, b)
    for a, b in zip(opt.master_params, masters):
        assert torch.equal(a, b)
    after = opt.optimizer.state_dict()["state"]
    for k in state:
        assert torch.equal(after[k]["momentum_buffer"], state[k]["momentum_buffer"])


def test_growth_after_window_and_state_dict_round_trip():
    model, _, data = model_and_data(torch.float16)
    opt = make(model, dynamic_loss_scale=True,
               dynamic_loss_args={"init_scale": 256.0, "scale_window": 3}, verbose=False)
    for x, y in data:
        opt.zero_grad()
        opt.backward(torch.nn.functional.mse_loss(model(x.half()).float(), y))
        opt.step()
    assert opt.loss_scale == 1024.0  # 6 clean steps, window 3: two growths
    sd = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = make(model2, dynamic_loss_scale=True,
                dynamic_loss_args={"init_scale": 256.0, "scale_window": 3}, verbose=False)
    opt2.load_state_dict(sd)
    assert opt2.loss_scale == 1024.0
    for a, b in zip(opt.master_params, opt2.master_params):
        assert torch.equal(a, b)


def test_bad_input():
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer"):
        with pytest.warns(DeprecationWarning):
            FP16_Optimizer(object())
    fp32 = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="no float16/bfloat16 parameters"):
        make(fp32)
    model, _, _ = model_and_data(torch.float16)
    with pytest.raises(ValueError, match="unknown keys"):
        make(model, dynamic_loss_scale=True, dynamic_loss_args={"scale": 2.0})
