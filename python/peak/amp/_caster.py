"""The O1 caster's Python side: a ``TorchFunctionMode`` whose ``__torch_function__`` is peak's C++
handler (``peak._C.caster.torch_function``), plus the on/off plumbing ``amp.initialize`` uses.

``enable(low_dtype)`` (called by ``amp.initialize(opt_level="O1")`` and ``amp.init``) pushes the mode
on the *calling thread's* torch-function mode stack, so from then on every torch function, Tensor
method and ``torch.nn.functional`` call in that thread -- the model's forward and the loss computed
outside it, CPU and CUDA tensors alike -- is looked up in the C++ policy tables and cast as Apex's O1
did. Other threads see no casting. ``disable()`` removes the mode and restores plain behaviour.
``disabled()`` (``amp.disable_casts()``, optimizer steps) suspends casting in this thread.
See docs/caster.md for the design.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

from .. import _C

_c = _C.caster

__all__ = ["enable", "disable", "is_enabled", "low_dtype", "region", "disabled", "clear_cache",
           "cache_stats"]


class CasterMode(TorchFunctionMode):
    """peak's O1 caster as a torch-function mode. The dispatch decision is C++ (no Python runs for
    an op): ``__torch_function__`` looks the called function up in the policy tables, casts the
    eligible arguments and calls it with torch's autocast keys excluded for that op only."""

    def __init__(self) -> None:
        super().__init__()
        self.__torch_function__ = _c.bind(self)  # a C++ builtin bound to this mode

    def __torch_function__(self, func, types, args=(), kwargs=None):  # replaced per instance
        raise RuntimeError("peak CasterMode: __torch_function__ is bound in __init__")


def _backward_hook(mode, func, args, kwargs):
    """``Tensor.backward`` under O1: torch pops a mode while its ``__torch_function__`` runs, so a
    plain call-through would run backward -- and the recomputation of ``torch.utils.checkpoint``
    -- uncast. Run the engine with the mode back on the stack instead (as Apex's process-wide
    patches did), so recomputed activations get the dtypes of the forward pass."""
    kwargs = kwargs or {}
    names = ("gradient", "retain_graph", "create_graph", "inputs")
    call = dict(zip(names, args[1:]), **kwargs)
    if func is not torch.Tensor.backward or call.get("inputs") is not None or _engine is None:
        return func(*args, **kwargs)
    tensors = (args[0],)
    grads = _engine["make_grads"](tensors, _engine["to_tuple"](call.get("gradient"), 1),
                                  is_grads_batched=False)
    create_graph = bool(call.get("create_graph", False))
    retain_graph = call.get("retain_graph")
    if retain_graph is None:
        retain_graph = create_graph
    torch._C._push_on_torch_function_stack(mode)
    try:
        _engine["run"](tensors, grads, retain_graph, create_graph, (), allow_unreachable=True,
                       accumulate_grad=True)
    finally:
        _remove_mode(mode)
    return None


try:  # torch internals used by _backward_hook (present in 2.3 .. 2.14); without them: call through
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward
    _engine = {"make_grads": _make_grads, "to_tuple": _tensor_or_tensors_to_tuple,
               "run": _engine_run_backward}
except ImportError:  # pragma: no cover
    _engine = None

_c.set_hook(_backward_hook)

_lock = threading.Lock()
_owner: dict = {"mode": None, "thread": None}  # where the mode was pushed


def _remove_mode(mode) -> None:
    """Take ``mode`` off this thread's torch-function mode stack (wherever it sits)."""
    above = []
    while torch._C._len_torch_function_stack() > 0:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for m in reversed(above):
        torch._C._push_on_torch_function_stack(m)


def enable(low_dtype: torch.dtype, allow_banned: bool = False) -> None:
    """Turn O1 casting on in this thread with ``low_dtype`` (torch.float16 or torch.bfloat16) as the
    lower precision; ``allow_banned=True`` lets banned functions run (in fp32) instead of raising."""
    if low_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"low_dtype must be torch.float16 or torch.bfloat16, got {low_dtype}")
    from . import lists  # noqa: PLC0415 (lists imports this module)

    disable()
    lists._ensure_defaults()
    lists._apply_registrations()
    _c.set_low_dtype(low_dtype)
    _c.set_allow_banned(bool(allow_banned))
    mode = CasterMode()
    torch._C._push_on_torch_function_stack(mode)
    with _lock:
        _owner["mode"], _owner["thread"] = mode, threading.get_ident()
    _c.set_thread_active(True)
    _c.clear_cache()


def disable() -> None:
    """Turn O1 casting off and restore plain behaviour (``initialize`` calls it before a new setup)."""
    from . import lists  # noqa: PLC0415

    _c.set_low_dtype(None)  # from here on the mode (wherever it is) only calls through
    _c.set_allow_banned(False)
    with _lock:
        mode, thread = _owner["mode"], _owner["thread"]
        _owner["mode"] = _owner["thread"] = None
    if mode is not None and thread == threading.get_ident():
        _remove_mode(mode)
    _c.set_thread_active(False)
    _c.clear_cache()
    lists._undo_registrations()


def is_enabled() -> bool:
    """True when O1 casts in this thread now."""
    return _c.is_casting()


def low_dtype() -> torch.dtype | None:
    return _c.low_dtype()


@contextlib.contextmanager
def region(device_type: str):
    """Kept for the amp models' forward: casting is thread-wide now, so this adds nothing."""
    yield


@contextlib.contextmanager
def disabled():
    """Run the body without O1 casts (exception safe, unlike Apex's ``disable_casts``)."""
    _c.suspend()
    try:
        yield
    finally:
        _c.resume()


def clear_cache() -> None:
    """Drop this thread's weight-cast cache (``scale_loss`` exit does it, as Apex)."""
    _c.clear_cache()


def cache_stats() -> dict:
    """This thread's weight-cast cache counters: hits, casts, stores, size."""
    return _c.cache_stats()
