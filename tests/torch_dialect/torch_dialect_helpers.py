"""Helpers for tests/torch_dialect (a module name of its own; see tests/peak_testing.py)."""
import copy

import torch

from peak_testing import HostReads  # noqa: F401 (re-exported: the tests import it here)


def make_model(seed=0, width=8, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width)).to(dtype)


def twin(model, opt_factory):
    """An identical copy of ``model`` with its own optimizer from ``opt_factory(params)``."""
    other = copy.deepcopy(model)
    return other, opt_factory(other.parameters())


def batches(n, width=8, batch=4, seed=1, inf_at=(), nan_at=()):
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
    return all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
