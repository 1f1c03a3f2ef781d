"""Checkpoint/resume driver shared by test_amp_checkpoint.py and the fresh process it starts.

    python amp_ckpt_worker.py DIR    # for every config: load DIR/<config>.ckpt.pt, train M more steps,
                                     # save DIR/<config>.resumed.pt
"""
import os
import sys

if __name__ == "__main__":  # a fresh process: amp_helpers needs tests/ (peak_testing) on the path
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import amp_helpers as H  # noqa: E402
from peak import amp  # noqa: E402
from peak.amp._amp_state import _amp_state  # noqa: E402

N_STEPS, M_STEPS = 4, 4
CONFIGS = {f"{level}-{name}": (level, dtype) for level in H.LEVELS for name, dtype in H.DTYPES.items()}


def build(level, low):
    model = H.make_cnn(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    model, opt = H.init(model, opt, level, low, max_loss_scale=2.0**14)
    for scaler in _amp_state.loss_scalers:
        scaler.growth_interval = 3  # let the dynamic scale grow within a few steps (not in the state dict)
    return model, opt


def train(model, opt, steps):
    dynamic = _amp_state.loss_scalers[0].dynamic
    for step in steps:
        x, y = H.batch(step, n=8, shape=(3, 6, 6))
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            if dynamic and step in (1, 5):  # overflows before and after the checkpoint
                next(model.parameters()).grad.view(-1)[0] = float("inf")
        opt.step()


def state(model, opt):
    return {"params": [p.detach().clone() for p in model.parameters()],
            "buffers": [b.clone() for b in model.buffers()],
            "model": model.state_dict(), "optimizer": opt.state_dict(), "amp": amp.state_dict()}


def resume(directory, name):
    level, low = CONFIGS[name]
    model, opt = build(level, low)
    ckpt = torch.load(f"{directory}/{name}.ckpt.pt", weights_only=False)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"])
    train(model, opt, range(N_STEPS, N_STEPS + M_STEPS))
    torch.save(state(model, opt), f"{directory}/{name}.resumed.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)  # tiny tensors (and the same thread count as the test process)
    for config_name in CONFIGS:
        resume(sys.argv[1], config_name)
