"""Shared helpers of the peak.amp tests (imported as a plain module: tests/amp is on sys.path).
The generic ones (make_mlp, snapshot, assert_bitwise_equal) are tests/peak_testing.py's, here
under the names the amp tests use (H.snapshot, ...)."""
import pytest
import torch
from torch import nn

from peak import amp
from peak_testing import assert_bitwise_equal, classification_batch, make_mlp, snapshot  # noqa: F401

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


def batch(step: int, n: int = 16, shape=(3, 8, 8), num_classes: int = 3):
    """Step ``step``'s batch of the amp tests (classification_batch seeded 1000 + step)."""
    return classification_batch(1000 + step, n, shape, num_classes)


def init(model, optimizer, level, dtype, **kwargs):
    kwargs.setdefault("verbosity", 0)
    return amp.initialize(model, optimizer, opt_level=level, low_precision_dtype=dtype, **kwargs)
