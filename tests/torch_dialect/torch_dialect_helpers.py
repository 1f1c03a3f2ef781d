"""Helpers for tests/torch_dialect (a module name of its own; see tests/peak_testing.py)."""
import copy

import torch

from peak_testing import bitwise_equal, make_mlp


def make_model(seed=0, width=8, dtype=torch.float32):
    """Linear(width, width) -> ReLU -> Linear(width, width)."""
    return make_mlp(seed, width, width, hidden=width, act=torch.nn.ReLU, dtype=dtype)


def twin(model, opt_factory):
    """An identical copy of ``model`` with its own optimizer from ``opt_factory(params)``."""
    other = copy.deepcopy(model)
    return other, opt_factory(other.parameters())


def batches(n, width=8, batch=4, seed=1, inf_at=(), nan_at=()):
    """``n`` batches from one generator; an inf (a NaN) in the inputs of the steps ``inf_at``
    (``nan_at``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(batch, width, generator=g)
        y = torch.randn(batch, width, generator=g)
        if i in inf_at:
            x[0, 0] = float("inf")
        if i in nan_at:
            x[1, 1] = float("nan")
        out.append((x, y))
    return out


def params_equal(m1, m2):
    """The two models' parameters bit for bit."""
    return bitwise_equal(list(m1.parameters()), list(m2.parameters()))
