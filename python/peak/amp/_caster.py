"""O1 caster hook -- INTERIM, MINIMAL IMPLEMENTATION.

``amp.initialize(opt_level="O1")`` calls ``enable(low_dtype)`` and ``disable()`` here; the models it
returns run their ``forward`` inside ``region(device_type)``, and ``disabled()`` switches casting off
(``amp.disable_casts()``, optimizer steps).

For now the casting itself is ``torch.autocast(device_type, dtype=low_dtype)`` entered and exited around
each amp model's forward, so O1 really trains in mixed precision today (on CPU and CUDA, fp16 and bf16).
Issue 4 replaces this module's body with peak's C++ caster (policy tables + thread-local state + weight
cast cache); the four functions below are the whole contract and stay.

Differences from Apex's O1 that this interim version has and the C++ caster removes: casts happen only
inside the forward of models passed to ``amp.initialize`` (Apex patched torch process-wide, so a loss
computed outside the model was cast too), and the op lists are PyTorch autocast's, not Apex's.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_dtype: torch.dtype | None = None  # the low-precision dtype while enabled (process-wide, like Apex)
_local = threading.local()  # per thread: depth of disabled() regions


def _suspended() -> int:
    return getattr(_local, "suspended", 0)


def enable(low_dtype: torch.dtype) -> None:
    """Turn O1 casting on with ``low_dtype`` (torch.float16 or torch.bfloat16) as the lower precision."""
    if low_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"low_dtype must be torch.float16 or torch.bfloat16, got {low_dtype}")
    global _dtype
    _dtype = low_dtype


def disable() -> None:
    """Turn O1 casting off (``initialize`` calls it before setting up a new state)."""
    global _dtype
    _dtype = None


def is_enabled() -> bool:
    return _dtype is not None and _suspended() == 0


def low_dtype() -> torch.dtype | None:
    return _dtype


@contextlib.contextmanager
def region(device_type: str):
    """Where casting applies: entered around each O1 model's forward."""
    if _dtype is None or _suspended():
        yield
        return
    with torch.autocast(device_type=device_type, dtype=_dtype):
        yield


@contextlib.contextmanager
def disabled():
    """Run the body without casts (exception safe, unlike Apex's ``disable_casts``)."""
    _local.suspended = _suspended() + 1
    try:
        with torch.autocast(device_type="cpu", enabled=False), _cuda_autocast_off():
            yield
    finally:
        _local.suspended -= 1


def _cuda_autocast_off():
    if torch.cuda.is_available():
        return torch.autocast(device_type="cuda", enabled=False)
    return contextlib.nullcontext()
