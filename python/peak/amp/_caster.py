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
import functools
import threading

import torch
from torch.overrides import TorchFunctionMode

from .. import _C

_c = _C.caster

__all__ = ["enable", "disable", "dispatch", "is_enabled", "low_dtype", "disabled", "clear_cache",
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


def run_autograd_in_mode(mode, func, args, kwargs):
    """Run an autograd entry point (``Tensor.backward``, ``torch.autograd.backward``,
    ``torch.autograd.grad``) with ``mode`` on the torch-function mode stack.

    torch pops a mode while its ``__torch_function__`` runs, so a plain call-through would run
    the engine -- and with it the recomputation of ``torch.utils.checkpoint`` -- without the
    mode: recomputed activations would not get the forward's dtypes (checkpoint then raises, or
    the gradients differ). So the argument handling of the entry point is done here and the
    engine is run with the mode back on the stack (as Apex's process-wide patches did). Used by
    the O1 caster's mode dispatch and by ``peak.amp.autocast``'s list edits."""
    kwargs = dict(kwargs or {})
    if _engine is None or func not in _AUTOGRAD_SIGNATURES:
        return func(*args, **kwargs)
    a = _AUTOGRAD_SIGNATURES[func].bind(*args, **kwargs)
    a.apply_defaults()
    a = a.arguments
    if func is torch.autograd.grad:
        if a["is_grads_batched"]:
            return func(*args, **kwargs)  # vmap over the engine: left to torch (not re-moded)
        outputs = (a["outputs"],) if _is_one(a["outputs"]) else tuple(a["outputs"])
        inputs = (a["inputs"],) if _is_one(a["inputs"]) else tuple(a["inputs"])
        allow_unused = a["allow_unused"]
        if a["materialize_grads"] and allow_unused is False:
            return func(*args, **kwargs)  # torch's own error
        if allow_unused is None:
            allow_unused = a["materialize_grads"]
        grads = _engine["make_grads"](outputs, _engine["to_tuple"](a["grad_outputs"], len(outputs)),
                                      is_grads_batched=False)
        retain_graph = a["create_graph"] if a["retain_graph"] is None else a["retain_graph"]
        with _mode_pushed(mode):
            result = _engine["run"](outputs, grads, retain_graph, a["create_graph"], inputs,
                                    allow_unused, accumulate_grad=False)
            if a["materialize_grads"]:
                result = tuple(r if r is not None else torch.zeros_like(i, requires_grad=True)
                               for r, i in zip(result, inputs))
        return result
    if func is torch.Tensor.backward:
        tensors, grad_tensors = a["self"], a["gradient"]
    else:
        tensors = a["tensors"]
        grad_tensors = a["grad_tensors"] if a["grad_variables"] is None else a["grad_variables"]
    inputs = a["inputs"]
    if inputs is not None and not _is_one(inputs) and len(inputs) == 0:
        return func(*args, **kwargs)  # torch's own error
    tensors = (tensors,) if _is_one(tensors) else tuple(tensors)
    inputs = (inputs,) if _is_one(inputs) else tuple(inputs) if inputs is not None else ()
    grads = _engine["make_grads"](tensors, _engine["to_tuple"](grad_tensors, len(tensors)),
                                  is_grads_batched=False)
    retain_graph = a["create_graph"] if a["retain_graph"] is None else a["retain_graph"]
    with _mode_pushed(mode):
        _engine["run"](tensors, grads, retain_graph, a["create_graph"], inputs,
                       allow_unreachable=True, accumulate_grad=True)
    return None


def _is_one(x) -> bool:
    return isinstance(x, torch.Tensor) or type(x).__name__ == "GradientEdge"


class _mode_pushed:
    def __init__(self, mode):
        self.mode = mode

    def __enter__(self):
        torch._C._push_on_torch_function_stack(self.mode)

    def __exit__(self, *exc):
        _remove_mode(self.mode)


def _backward_hook(mode, func, args, kwargs):
    """The C++ handler's hook for the autograd entry points (policy "hook"): see
    ``run_autograd_in_mode``."""
    return run_autograd_in_mode(mode, func, args, kwargs)


try:  # torch internals used by run_autograd_in_mode (present in 2.3 .. 2.14); else call through
    import inspect as _inspect

    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward
    _engine = {"make_grads": _make_grads, "to_tuple": _tensor_or_tensors_to_tuple,
               "run": _engine_run_backward}
    _AUTOGRAD_SIGNATURES = {f: _inspect.signature(f) for f in
                            (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)}
except (ImportError, ValueError, TypeError):  # pragma: no cover
    _engine = None
    _AUTOGRAD_SIGNATURES = {}

#: The autograd entry points that get the "hook" policy (see run_autograd_in_mode).
AUTOGRAD_ENTRIES = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)

_c.set_hook(_backward_hook)

_lock = threading.Lock()
# Threads with O1 on (their ident -> dispatch) and the CasterMode pushed in each mode thread. The
# patch wrappers are process-wide: installed by the first thread that turns O1 on with "patch",
# removed when the last thread with O1 on turns it off (each thread's casting is its own).
_on: dict = {}
_modes: dict = {}


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


#: How casts are dispatched: "patch" (default) puts a C++ wrapper in place of each listed callable
#: in torch, torch.nn.functional, torch.Tensor and torch._VF (as Apex patched them, but gated per
#: thread), so unlisted ops pay nothing; "mode" pushes CasterMode, which sees every call.
DISPATCHES = ("patch", "mode")
_state: dict = {"default": "patch"}


def enable(low_dtype: torch.dtype, allow_banned: bool = False, dispatch: str | None = None) -> None:
    """Turn O1 casting on in this thread with ``low_dtype`` (torch.float16 or torch.bfloat16) as the
    lower precision; ``allow_banned=True`` lets banned functions run (in fp32) instead of raising;
    ``dispatch`` picks the mechanism (see ``DISPATCHES``)."""
    if low_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"low_dtype must be torch.float16 or torch.bfloat16, got {low_dtype}")
    if dispatch is None:
        dispatch = _state["default"]
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
    from . import lists  # noqa: PLC0415 (lists imports this module)

    disable()
    lists._ensure_defaults()
    _index()  # before anything is patched
    ident = threading.get_ident()
    with _lock:
        lists._apply_registrations()
        if dispatch == "mode":
            mode = _modes[ident] = CasterMode()
            torch._C._push_on_torch_function_stack(mode)
        else:
            for fn, code in _c.table():
                if code != _c.POLICY_hook:
                    _patch(fn)
            for fn in lists._local_functions():  # a lists.local block entered before O1
                _patch(fn)
        _install_rnn_check()
        _install_checkpoint_state()
        _on[ident] = dispatch
    _c.set_low_dtype(low_dtype)
    _c.set_allow_banned(bool(allow_banned))
    _c.set_thread_active(True)
    _c.clear_cache()


def disable() -> None:
    """Turn O1 casting off in this thread (``initialize`` calls it before a new setup). When no
    thread has O1 on any more, plain behaviour is restored exactly (wrappers and registrations
    removed); other threads' casting is not touched."""
    from . import lists  # noqa: PLC0415

    _c.set_thread_active(False)  # from here on this thread's calls go straight through
    _c.set_low_dtype(None)
    _c.set_allow_banned(False)
    _c.clear_cache()
    ident = threading.get_ident()
    with _lock:
        mode = _modes.pop(ident, None)
        _on.pop(ident, None)
        alive = {t.ident for t in threading.enumerate()}
        for gone in [t for t in _on if t not in alive]:  # threads that ended with O1 on
            del _on[gone]
            _modes.pop(gone, None)
        last = not _on
        if last:
            _unpatch_all()
            _remove_rnn_check()
            _remove_checkpoint_state()
            lists._undo_registrations()
    if mode is not None:
        _remove_mode(mode)


# ---- nn.RNN/LSTM/GRU under O1

_rnn_check: dict = {}  # "orig": RNNBase.check_input while some thread has O1 on
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)  # what O1 casts (not float64)


def _rnn_check_input(self, input, batch_sizes):
    """RNNBase.check_input, without its input-vs-weight dtype check while O1 casts in this thread:
    O1 casts the RNN op's input and weights alike (torch._VF.lstm & co. are listed), and torch
    skips the same check under autocast for the same reason. An fp16/bf16 input (the output of a
    cast Linear, of a previous LSTM) would otherwise be refused by the fp32 module."""
    weights = self._flat_weights
    w = weights[0] if weights else None
    if (w is not None and input.dtype != w.dtype and input.dtype in _CASTABLE
            and w.dtype in _CASTABLE and _c.is_casting()):
        input = torch.empty(input.shape, dtype=w.dtype, device="meta")  # shape checks only
    return _rnn_check["orig"](self, input, batch_sizes)


def _install_rnn_check() -> None:
    if not _rnn_check:
        _rnn_check["orig"] = torch.nn.RNNBase.__dict__["check_input"]
        torch.nn.RNNBase.check_input = _rnn_check_input


def _remove_rnn_check() -> None:
    if _rnn_check:
        torch.nn.RNNBase.check_input = _rnn_check.pop("orig")


# ---- torch.utils.checkpoint: recompute under the forward's caster state

_checkpoint: dict = {}  # the originals replaced in torch.utils.checkpoint while O1 is on


def _under_current_state(fn):
    """``fn``, to be run later under the caster state in effect now (NOTE: [Checkpoint
    recomputation] in csrc/caster/caster.cpp), as torch.utils.checkpoint re-enters the forward's
    autocast state for the recomputation."""
    state = _c.snapshot()
    # Under the mode dispatch the casts come from a CasterMode on the stack: the recomputation
    # needs one too if O1 was switched off (in this thread) since the forward.
    needs_mode = _on.get(threading.get_ident()) == "mode"

    def run(*args, **kwargs):  # (not wraps(fn): fn may be a module, and its __dict__ large)
        _c.push_state(state)
        mode = None
        if needs_mode and not any(isinstance(m, CasterMode)
                                  for m in torch.overrides._get_current_function_mode_stack()):
            mode = CasterMode()
            torch._C._push_on_torch_function_stack(mode)
        try:
            return fn(*args, **kwargs)
        finally:
            if mode is not None:
                _remove_mode(mode)
            _c.pop_state()

    return run


class _CheckpointFunctionProxy:
    """Stands in for torch.utils.checkpoint.CheckpointFunction while O1 is on: ``apply`` (what
    checkpoint() calls) hands the real Function a run_function that runs under the forward's
    state; anything else is the real Function's (no Function subclass is made at run time)."""

    def __init__(self, function):
        self._function = function

    def apply(self, run_function, preserve_rng_state, *args):
        return self._function.apply(_under_current_state(run_function), preserve_rng_state, *args)

    def __getattr__(self, name):
        return getattr(self._function, name)


def _install_checkpoint_state() -> None:
    """checkpoint() looks both of these up in its module at each call: the non-reentrant path
    calls the generator (whose ``fn`` is used only to recompute), the reentrant one
    CheckpointFunction (whose run_function runs in the forward, under the state it captures
    itself, and again in backward)."""
    if _checkpoint:
        return
    import torch.utils.checkpoint as ckpt  # noqa: PLC0415

    # torch 2.14 calls _checkpoint_without_reentrant_generator_impl (the old name forwards to
    # it); 2.13 has only the old one. Both take the function to recompute first.
    name = ("_checkpoint_without_reentrant_generator_impl"
            if hasattr(ckpt, "_checkpoint_without_reentrant_generator_impl")
            else "_checkpoint_without_reentrant_generator")
    generator = getattr(ckpt, name)
    function = ckpt.CheckpointFunction

    def checkpoint_without_reentrant_generator(fn, *args, **kwargs):
        return generator(_under_current_state(fn), *args, **kwargs)

    _checkpoint.update(module=ckpt, name=name, generator=generator, function=function)
    setattr(ckpt, name, checkpoint_without_reentrant_generator)
    ckpt.CheckpointFunction = _CheckpointFunctionProxy(function)


def _remove_checkpoint_state() -> None:
    if _checkpoint:
        ckpt = _checkpoint.pop("module")
        setattr(ckpt, _checkpoint.pop("name"), _checkpoint.pop("generator"))
        ckpt.CheckpointFunction = _checkpoint.pop("function")


# ---- patch dispatch

_sites: dict = {}  # id(callable) -> [(owner, name)] where torch code finds it
_patched: list = []  # (owner, name, had_own_attribute, previous value), in patch order
_patched_ids: set = set()
_RNN = ("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell",
        "rnn_relu_cell")


def _index() -> dict:
    """Where each callable of torch's public namespaces lives (built once, before any patching)."""
    if _sites:
        return _sites
    import torch.nn.functional as F  # noqa: PLC0415

    # Not torch._C._nn: F's builtins (F.linear, F.gelu) live there too, and pickle finds a
    # builtin by its __module__ (torch._C._nn): patching it there would make a model that holds
    # F.gelu (e.g. an activation module) unpicklable while O1 is on.
    owners = [torch, F, torch.Tensor, torch.linalg, torch.special, torch.fft, torch.sparse]
    for owner in owners:
        for name in dir(owner):
            try:
                obj = getattr(owner, name)
            except Exception:  # noqa: BLE001 (some attributes raise on access)
                continue
            if callable(obj) and not isinstance(obj, type):
                _sites.setdefault(id(obj), []).append((owner, name))
    for name in _RNN:  # nn.LSTM & co. call torch._VF.<name> (a module forwarding to torch._C)
        obj = getattr(torch._C._VariableFunctions, name, None)
        if obj is not None:
            _sites.setdefault(id(obj), []).append((torch._VF, name))
    return _sites


def _patch(fn) -> bool:
    """Put a C++ wrapper of ``fn`` at each place torch code looks it up. False if none is known."""
    # The index is keyed by id(): keep only the sites that still hold this very object.
    sites = [(o, n) for o, n in _index().get(id(fn), []) if unwrap(getattr(o, n, None)) is fn]
    if not sites:
        return False
    if id(fn) in _patched_ids:
        return True
    _patched_ids.add(id(fn))
    wrapper = _c.wrap(fn)  # NOTE: [Patch wrapper objects] in csrc/caster/caster.cpp
    functools.update_wrapper(wrapper, fn)
    for owner, name in sites:
        own = owner.__dict__ if isinstance(owner, type) else vars(owner)
        had = name in own
        prev = own.get(name)
        setattr(owner, name, _c.instancemethod(wrapper) if isinstance(owner, type) else wrapper)
        _patched.append((owner, name, had, prev))
    return True


def unwrap(obj):
    """``obj`` itself, or the torch callable behind one of the patch dispatch's wrappers (what
    ``torch.mm`` is while O1 is on)."""
    return _c.unwrap(obj)


def _unpatch_all() -> None:
    while _patched:
        owner, name, had, prev = _patched.pop()
        if had:
            setattr(owner, name, prev)
        else:
            delattr(owner, name)
    _patched_ids.clear()


def dispatch() -> str | None:
    """The dispatch O1 uses in this thread ("patch" or "mode"), or None when it is off here."""
    return _on.get(threading.get_ident())


def patched() -> bool:
    """Whether the patch dispatch's wrappers are installed (some thread uses it)."""
    return bool(_patched)


def is_enabled() -> bool:
    """True when O1 casts in this thread now."""
    return _c.is_casting()


def low_dtype() -> torch.dtype | None:
    return _c.low_dtype()


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
