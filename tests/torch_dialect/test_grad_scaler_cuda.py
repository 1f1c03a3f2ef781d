"""GradScaler with peak's fused optimizers on CUDA models: no host sync in ``step`` + ``update``
(``torch.cuda.set_sync_debug_mode("error")`` turns any sync into an error), dynamic fp16 scaling
with a skipped step, and the default device. The CPU half of each device-parametrized test runs
the same steps here and counts Python-level host reads instead (no_host_sync)."""
import pytest
import torch

from peak import amp
from peak.optimizers import FusedAdam, FusedLAMB, FusedSGD

from peak_testing import (DEVICES, assert_poisoned_steps_skipped, make_mlp, no_host_sync,
                          state_tensors)

F = torch.nn.functional

OPTIMIZERS = {
    "adamw": lambda ps: FusedAdam(ps, lr=1e-3, adam_w_mode=True),
    "adam_lean_8bit": lambda ps: FusedAdam(ps, lr=1e-3, adam_w_mode=True, exp_avg_dtype=torch.uint8,
                                           exp_avg_sq_dtype=torch.uint8),
    "sgd_clip": lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9, max_grad_norm=1.0),
    "lamb": lambda ps: FusedLAMB(ps, lr=1e-3),
}
SCALERS = {"peak": lambda dev: amp.GradScaler(dev, init_scale=2.0**8, growth_interval=3),
           "torch": lambda dev: torch.amp.GradScaler(dev, init_scale=2.0**8, growth_interval=3)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scaler_name", list(SCALERS))
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_step_and_update_do_not_sync_and_skip_on_overflow(opt_name, scaler_name, device):
    """An fp16 model (fp32 masters in the optimizer), dynamic loss scaling from 2^8 (no gradient
    overflows by itself): 8 iterations with GradScaler.step + update under the no-sync guard;
    iteration 4 gets an inf gradient, is skipped bit for bit and halves the scale; the growth
    interval doubles it later."""
    model = make_mlp(0, 32, 8, hidden=64, act=torch.nn.ReLU, device=device).half()
    opt = OPTIMIZERS[opt_name](model.parameters())
    scaler = SCALERS[scaler_name](device)
    g = torch.Generator().manual_seed(1)

    def step(i, poison):
        x = torch.randn(16, 32, generator=g).to(device).half()
        y = torch.randn(16, 8, generator=g).to(device)
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x).float(), y)).backward()
        if poison:
            model[0].weight.grad[1, 2] = float("inf")
        with no_host_sync(device):
            scaler.step(opt)
            scaler.update()
        return scaler.get_scale()

    scales = assert_poisoned_steps_skipped(step, 8, {4}, lambda: state_tensors(model, opt),
                                           scale=scaler.get_scale, clean_steps_change=True)
    assert scales[-1] > scales[4]


@pytest.mark.cuda
def test_default_device_is_cuda_like_torch():
    """On a GPU machine GradScaler() means CUDA, as torch's: enabled, state on the GPU."""
    ours, theirs = amp.GradScaler(), torch.amp.GradScaler()
    assert ours._device == theirs._device == "cuda" and ours.is_enabled()
    loss = torch.ones((), device="cuda")
    assert ours.scale(loss).item() == theirs.scale(loss).item() == 2.0**16
    assert ours._scale.device.type == "cuda"
