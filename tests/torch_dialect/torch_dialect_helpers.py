"""Helpers for tests/torch_dialect (a module name of its own; see tests/peak_testing.py)."""
import contextlib
import copy

import torch


class HostReads:
    """Counts Python-level host reads of tensors (``.item()``, ``.tolist()``, ``bool()``,
    ``float()``, ``int()``): on CUDA each is a device->host sync."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__")

    def __init__(self):
        self.count = 0

    @contextlib.contextmanager
    def counting(self):
        originals = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def wrap(fn):
            def counted(t, *a, **k):
                self.count += 1
                return fn(t, *a, **k)
            return counted

        for n, fn in originals.items():
            setattr(torch.Tensor, n, wrap(fn))
        try:
            yield self
        finally:
            for n, fn in originals.items():
                setattr(torch.Tensor, n, fn)


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
