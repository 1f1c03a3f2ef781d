"""Shared helpers of the peak.amp tests (imported as a plain module: tests/amp is on sys.path)."""
import copy

import pytest
import torch
from torch import nn

from peak import amp

LEVELS = ["O0", "O1", "O2", "O3"]
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}
CONFIGS = [pytest.param(level, DTYPES[name], id=f"{level}-{name}") for level in LEVELS for name in DTYPES]
LOW = (torch.float16, torch.bfloat16)


def make_cnn(seed: int = 0, num_classes: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes),
    )


def make_mlp(seed: int = 0, d_in: int = 6, d_out: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out))


def batch(step: int, n: int = 16, shape=(3, 8, 8), num_classes: int = 3):
    """Deterministic synthetic data: the label is the channel with the largest mean (learnable)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, *shape, generator=g)
    if len(shape) == 3:
        y = x.mean(dim=(2, 3))[:, :num_classes].argmax(dim=1)
    else:
        y = x[:, :num_classes].argmax(dim=1)
    return x, y


def init(model, optimizer, level, dtype, **kwargs):
    kwargs.setdefault("verbosity", 0)
    return amp.initialize(model, optimizer, opt_level=level, low_precision_dtype=dtype, **kwargs)


def snapshot(model, optimizer=None):
    """Deep copies of everything an optimizer step could change: model parameters, the params the
    optimizer holds (fp32 masters under O2) and the optimizer state."""
    snap = {"model": {k: v.detach().clone() for k, v in model.named_parameters()}}
    if optimizer is not None:
        snap["params"] = [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]
        snap["opt"] = copy.deepcopy(optimizer.state_dict())
    return snap


def assert_bitwise_equal(a, b, path="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a.detach(), b.detach()) or (
            torch.isnan(a).any() and torch.equal(torch.nan_to_num(a.detach()), torch.nan_to_num(b.detach()))
        ), f"{path}: values differ (max abs diff {(a.double() - b.double()).abs().max().item()})"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"
