"""The O1 caster's Python side: turning it on and off per thread, and the state that goes with it.

``enable(low_dtype)`` (called by ``amp.initialize(opt_level="O1")`` and ``amp.init``) makes every
listed torch function, Tensor method and ``torch.nn.functional`` call of the *calling thread* go
through peak's C++ caster (``peak._C.caster``), which looks it up in the policy tables and casts as
Apex's O1 did; other threads see no casting. Two dispatches reach the C++ code (``DISPATCHES``):
"patch" (C++ wrappers in place of the listed callables) and "mode" (``CasterMode``, a
torch-function mode whose ``__torch_function__`` is C++). ``disable()`` restores plain behaviour;
``disabled()`` (``amp.disable_casts()``, optimizer steps) suspends casting in this thread.

This module owns the caster's Python-side state: which threads have O1 on and how, the
process-wide patch wrappers, the default lists (loaded once), the ``register_*_function``
registrations and this thread's ``lists.local`` frames. ``peak.amp.lists`` edits it through the
public functions below; the torch-private hooks it installs live in ``_torch_hooks``.
See docs/caster.md for the design.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading

import torch
from torch.overrides import TorchFunctionMode

from .. import _C
from . import _torch_hooks

_c = _C.caster

__all__ = ["enable", "disable", "dispatch", "is_enabled", "low_dtype", "disabled", "clear_cache",
           "cache_stats", "CODES", "POLICIES", "ensure_defaults", "set_policies", "reset_lists",
           "local_edits", "is_interceptable", "decorator", "register", "set_default_dispatch"]


class CasterMode(TorchFunctionMode):
    """peak's O1 caster as a torch-function mode. The dispatch decision is C++ (no Python runs for
    an op): ``__torch_function__`` looks the called function up in the policy tables, casts the
    eligible arguments and calls it with torch's autocast keys excluded for that op only."""

    def __init__(self) -> None:
        super().__init__()
        self.__torch_function__ = _c.bind(self)  # a C++ builtin bound to this mode

    def __torch_function__(self, func, types, args=(), kwargs=None):  # replaced per instance
        raise RuntimeError("peak CasterMode: __torch_function__ is bound in __init__")


# Re-exported: autocast's list edits and the tests reach them through this module too.
AUTOGRAD_ENTRIES = _torch_hooks.AUTOGRAD_ENTRIES
run_autograd_in_mode = _torch_hooks.run_autograd_in_mode

# The C++ handler's hook for the autograd entry points (policy "hook").
_c.set_hook(_torch_hooks.run_autograd_in_mode)

_lock = threading.Lock()
# Threads with O1 on (their ident -> dispatch) and the CasterMode pushed in each mode thread. The
# patch wrappers are process-wide: installed by the first thread that turns O1 on with "patch",
# removed when the last thread with O1 on turns it off (each thread's casting is its own).
_on: dict = {}
_modes: dict = {}

#: How casts are dispatched: "patch" (default) puts a C++ wrapper in place of each listed callable
#: in torch, torch.nn.functional, torch.Tensor and torch._VF (as Apex patched them, but gated per
#: thread), so unlisted ops pay nothing; "mode" pushes CasterMode, which sees every call.
DISPATCHES = ("patch", "mode")
_default_dispatch: dict = {"dispatch": "patch"}


def set_default_dispatch(dispatch: str) -> None:
    """The dispatch the next ``enable`` without an explicit one uses (``lists.set_dispatch``)."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
    _default_dispatch["dispatch"] = dispatch


# ---- the lists (tables in C++; peak.amp.lists is their public face)

#: policy name -> the C++ table's code.
CODES = {name: getattr(_c, "POLICY_" + name) for name in (
    "lower", "fp32", "promote", "sequence_promote", "banned", "inplace_fp32", "match_self", "hook")}
#: The policy names ``lists.add`` accepts.
POLICIES = tuple(n for n in CODES if n != "hook")
_defaults_loaded: dict = {"loaded": False}


def ensure_defaults() -> None:
    """Load Apex's O1 lists into the C++ table, once (at the first use of the lists or of O1)."""
    if not _defaults_loaded["loaded"]:
        _defaults_loaded["loaded"] = True
        _load_defaults()


def _load_defaults() -> None:
    import torch.nn.functional as F  # noqa: PLC0415 (torch.nn is imported by then anyway)

    where = {"torch": torch, "functional": F, "Tensor": torch.Tensor}
    for owner, name, code in _c.default_entries():
        fn = unwrap(getattr(where[owner], name, None))
        if fn is not None and callable(fn):
            _c.set_policy(fn, code)
    for fn in AUTOGRAD_ENTRIES:  # see _torch_hooks.run_autograd_in_mode
        _c.set_policy(fn, CODES["hook"])


def set_policies(funcs, code: int) -> None:
    """Give each of ``funcs`` (unwrapped torch callables) the policy ``code`` (0: unlisted),
    process-wide; under the patch dispatch a newly listed function gets its wrapper now."""
    ensure_defaults()
    for fn in funcs:
        _c.set_policy(fn, code)
    if code and patched():
        for fn in funcs:
            _patch(fn)


def reset_lists() -> None:
    """Back to Apex's O1 lists: every edit and registration dropped."""
    _undo_registrations()
    _pending.clear()
    _c.clear_table()
    _defaults_loaded["loaded"] = True
    _load_defaults()
    if patched():
        for fn, code in _c.table():
            if code != CODES["hook"]:
                _patch(fn)


def is_interceptable(fn) -> bool:
    """Whether calls of ``fn`` can reach the caster (a torch callable, or an autograd entry)."""
    fn = unwrap(fn)
    return id(fn) in index() or fn in AUTOGRAD_ENTRIES


# This thread's open local_edits() frames (their functions), so that an O1 switched on inside
# one patches them too.
_local_frames = threading.local()


@contextlib.contextmanager
def local_edits(codes: dict):
    """This thread's policy ``codes`` ({unwrapped callable: code, 0 for unlisted}) on top of the
    process-wide table, inside the ``with`` block (a C++ local-edit frame)."""
    ensure_defaults()
    _c.push_local(codes)
    _local_frames.__dict__.setdefault("stack", []).append(codes)
    try:
        if dispatch() == "patch":
            for fn in codes:
                _patch(fn)
        yield
    finally:
        _local_frames.stack.pop()
        _c.pop_local()


def _local_functions() -> list:
    return [fn for codes in getattr(_local_frames, "stack", ()) for fn in codes]


# ---- user functions (Apex's decorators and registrations)

def decorator(policy: str):
    """The decorator that runs a function under ``policy`` while O1 casts (amp.half_function & co.)."""
    code = CODES[policy]

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return _c.call(code, fn, args, kwargs or None)

        wrapper.__peak_cast_policy__ = policy
        return wrapper

    return decorate


_pending: list = []  # (module, name, policy), applied by the next enable (as Apex)
_applied: list = []  # (module, name, policy, original, previous table code) to undo on disable


def register(module, name: str, policy: str) -> None:
    """Have the next ``enable`` patch ``module.name`` with ``policy``'s wrapper (checked by the
    caller, ``lists.register_*_function``)."""
    _pending.append((module, name, policy))


_REGISTER_NAMES = {"lower": "half", "fp32": "float", "promote": "promote"}


def _apply_registrations() -> None:
    """Patch each registered ``module.name`` with the policy's wrapper and list the original, so that
    the registration wins over the built-in lists (Apex: user casts run innermost)."""
    for module, name, policy in list(_pending):  # all checked before any is applied
        if not callable(getattr(module, name, None)):  # changed since it was registered
            _pending.remove((module, name, policy))
            raise TypeError(f"register_{_REGISTER_NAMES[policy]}_function: {module!r}.{name} is "
                            f"no longer a function; that registration is dropped")
    while _pending:
        module, name, policy = _pending.pop(0)
        had, own = name in vars(module), vars(module).get(name)
        # The descriptor itself, also when a class inherits it (getattr would hand back the
        # function a staticmethod holds, or a classmethod bound to this class).
        raw = own
        if isinstance(module, type):
            try:
                raw = inspect.getattr_static(module, name)
            except AttributeError:  # found only through a metaclass __getattr__
                raw = None
        orig = getattr(module, name)
        # A class's static/class methods stay what they are (wrapping what getattr returns would
        # turn a staticmethod into an instance method, and bind a classmethod to this class).
        if isinstance(raw, staticmethod):
            new = staticmethod(decorator(policy)(raw.__func__))
        elif isinstance(raw, classmethod):
            new = classmethod(decorator(policy)(raw.__func__))
            orig = raw.__func__
        else:
            new = decorator(policy)(orig)
        _applied.append((module, name, policy, had, own, orig, _c.get_policy(orig)))
        _c.set_policy(orig, CODES[policy])
        setattr(module, name, new)


def _undo_registrations() -> None:
    """Restore the registered functions (O1 off: plain behaviour), keeping the registrations for
    the next O1 initialize: Apex's patches, once made, stayed for every later initialize."""
    while _applied:
        module, name, policy, had, raw, orig, code = _applied.pop()
        if had:
            setattr(module, name, raw)  # the very object that was there (descriptor included)
        else:
            delattr(module, name)  # it was inherited or found through __getattr__
        _c.set_policy(orig, code)
        _pending.insert(0, (module, name, policy))


# ---- on / off

def enable(low_dtype: torch.dtype, allow_banned: bool = False, dispatch: str | None = None) -> None:
    """Turn O1 casting on in this thread with ``low_dtype`` (torch.float16 or torch.bfloat16) as the
    lower precision; ``allow_banned=True`` lets banned functions run (in fp32) instead of raising;
    ``dispatch`` picks the mechanism (see ``DISPATCHES``)."""
    if low_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"low_dtype must be torch.float16 or torch.bfloat16, got {low_dtype}")
    if dispatch is None:
        dispatch = _default_dispatch["dispatch"]
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {DISPATCHES}, got {dispatch!r}")
    disable()
    ensure_defaults()
    index()  # before anything is patched
    ident = threading.get_ident()
    with _lock:
        _apply_registrations()
        if dispatch == "mode":
            mode = _modes[ident] = CasterMode()
            torch._C._push_on_torch_function_stack(mode)
        else:
            for fn, code in _c.table():
                if code != _c.POLICY_hook:
                    _patch(fn)
            for fn in _local_functions():  # a lists.local block entered before O1
                _patch(fn)
        _torch_hooks.install_rnn_check()
        _torch_hooks.install_checkpoint(_under_current_state)
        _on[ident] = dispatch
    _c.set_low_dtype(low_dtype)
    _c.set_allow_banned(bool(allow_banned))
    _c.set_thread_active(True)
    _c.clear_cache()


def disable() -> None:
    """Turn O1 casting off in this thread (``initialize`` calls it before a new setup). When no
    thread has O1 on any more, plain behaviour is restored exactly (wrappers and registrations
    removed); other threads' casting is not touched."""
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
            _torch_hooks.remove_rnn_check()
            _torch_hooks.remove_checkpoint()
            _undo_registrations()
    if mode is not None:
        _torch_hooks.remove_mode(mode)



def _under_current_state(fn):
    """``fn``, to be run later under the caster state in effect now (NOTE: [Checkpoint
    recomputation] in csrc/caster/state.cpp), as torch.utils.checkpoint re-enters the forward's
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
                _torch_hooks.remove_mode(mode)
            _c.pop_state()

    return run


# ---- patch dispatch

_sites: dict = {}  # id(callable) -> [(owner, name)] where torch code finds it
_patched: list = []  # (owner, name, had_own_attribute, previous value), in patch order
_patched_ids: set = set()
_RNN = ("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell",
        "rnn_relu_cell")


def index() -> dict:
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
    sites = [(o, n) for o, n in index().get(id(fn), []) if unwrap(getattr(o, n, None)) is fn]
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



_index = index  # the name the tests (and earlier code) use


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
