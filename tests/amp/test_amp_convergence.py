"""A small CNN with batch norm trains under every opt_level and dtype about as well as fp32 (O0).

Tolerance: after STEPS steps the mean loss of the last 5 steps is within 0.1 (absolute; the initial loss
is ~1.1) of O0's, and at most 60% of the initial loss.
"""
import pytest
import torch
from torch import nn

from peak import amp

import amp_helpers as H

STEPS = 40
_O0_CACHE = {}


def _train(level, low):
    model = H.make_cnn(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    H.init(model, opt, level, low)
    losses = []
    for step in range(STEPS):
        x, y = H.batch(step % 10, n=32, shape=(3, 8, 8))  # 10 fixed batches, 4 passes
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _tail(losses):
    return sum(losses[-5:]) / 5


@pytest.mark.parametrize("level, low", H.CONFIGS)
def test_converges_like_fp32(level, low):
    if "O0" not in _O0_CACHE:
        _O0_CACHE["O0"] = _train("O0", torch.float16)  # O0 ignores the low dtype
    reference = _O0_CACHE["O0"]
    losses = _train(level, low)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert _tail(losses) <= 0.6 * losses[0], losses
    assert abs(_tail(losses) - _tail(reference)) <= 0.1, (_tail(losses), _tail(reference))
