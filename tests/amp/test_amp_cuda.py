"""amp O0-O3 and the O1 caster on CUDA models, parametrized over devices: the CPU half runs the
same training and checks here; the CUDA half needs a GPU. A training run on CUDA cannot be
compared bit for bit with the CPU (cuBLAS and the CPU's matmuls round differently), so each run
is checked for what the design promises on any device: dtypes of weights, masters, gradients and
outputs, a skipped step that leaves everything bit for bit, and a falling loss."""
import pytest
import torch
import torch.nn.functional as F

from peak import amp
from peak.amp import _caster
from peak.optimizers import FusedAdam, FusedSGD

import amp_helpers as H
from peak_testing import (DEVICES, assert_poisoned_steps_skipped, make_mlp, no_host_sync,
                          snapshot)


def make_model(device):
    return make_mlp(0, 32, 8, hidden=64, act=torch.nn.ReLU, device=device)


def data(device, steps):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(32, 8, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=g)
        out.append((x.to(device), (x @ w).to(device)))
    return out


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "fused_adam": lambda ps: FusedAdam(ps, lr=2e-2, adam_w_mode=True),
    "fused_sgd_clip": lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9, max_grad_norm=1.0),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("level, low", H.CONFIGS)
def test_training_on_device(level, low, opt_name, device):
    model = make_model(device)
    opt = OPTIMIZERS[opt_name](model.parameters())
    model, opt = H.init(model, opt, level, low)
    expect_model = low if level in ("O2", "O3") else torch.float32
    assert all(p.dtype == expect_model and p.device.type == device for p in model.parameters())
    steps = data(device, 30)

    def step(i, poison):
        x, y = steps[i]
        opt.zero_grad()
        out = model(x)
        if level == "O1":
            assert out.dtype == low  # the caster ran the Linear in low precision
        loss = F.mse_loss(out.float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            if poison:
                next(model.parameters()).grad.view(-1)[3] = float("inf")
        opt.step()
        return loss.item()

    # an overflowing gradient under dynamic scaling (fp16 O1/O2): the check on leaving scale_loss
    # sees it, and the step is skipped, leaving everything bit for bit
    poisoned = {20} if level in ("O1", "O2") and low == torch.float16 else set()
    losses = assert_poisoned_steps_skipped(step, len(steps), poisoned, lambda: snapshot(model, opt))
    losses = [loss for i, loss in enumerate(losses) if i not in poisoned]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5]), losses
    if level == "O2":
        for p in amp.master_params(opt):
            assert p.dtype == torch.float32 and p.device.type == device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_o1_caster_on_device_tensors(low, device):
    """The C++ caster's policy on tensors of the device: low-precision ops, fp32 ops, promotion,
    and the weight-cast cache (one cast per weight per iteration)."""
    w = torch.nn.Parameter(torch.randn(16, 16, device=device))
    x = torch.randn(4, 16, device=device)
    _caster.enable(low)
    try:
        _caster.clear_cache()
        s0 = _caster.cache_stats()
        y = F.linear(x, w) + F.linear(x, w)
        s1 = _caster.cache_stats()
        assert y.dtype == low and y.device.type == device
        assert s1["stores"] - s0["stores"] == 1 and s1["hits"] - s0["hits"] == 1
        assert torch.exp(y).dtype == torch.float32
        assert torch.addcmul(x, y, y).dtype == torch.float32  # promoted to the widest
        y.float().sum().backward()
        assert w.grad.dtype == torch.float32 and w.grad.device.type == device
        with _caster.disabled():
            ref = 2 * (torch.ones(4, 16, device=device).t() @ x.to(low).float())
        torch.testing.assert_close(w.grad, ref, rtol=2e-2, atol=2e-2)
    finally:
        _caster.clear_cache()
        _caster.disable()


@pytest.mark.parametrize("device", DEVICES)
def test_scale_loss_exit_and_the_fused_step_never_sync(device):
    """O2 fp16 with FusedAdam and dynamic scaling: neither the exit of scale_loss nor the fused
    step reads a tensor on the host (CUDA: the sync debug mode raises on any sync; the CPU: no
    host read), through an overflow too; the skip is decided on the device."""
    model = make_model(device)
    opt = FusedAdam(model.parameters(), lr=5e-3, adam_w_mode=True)
    model, opt = H.init(model, opt, "O2", torch.float16)
    scaler = amp._amp_state.loss_scalers[0]
    for i, (x, y) in enumerate(data(device, 3)):
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        scaled_cm = amp.scale_loss(loss, opt)
        scaled = scaled_cm.__enter__()
        scaled.backward()
        if i == 1:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
            scale = scaler.loss_scale()
        with no_host_sync(device):
            scaled_cm.__exit__(None, None, None)
            opt.step()
        if i == 1:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            assert scaler.loss_scale() == scale / 2
