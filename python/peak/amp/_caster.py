"""The O1 caster's Python side, and the one owner of its state: which threads have O1 on, the
C++ wrappers put in place of the listed torch callables and who holds them, the lists and
registrations, and this thread's list-edit frames. Design: docs/caster.md."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading

import torch

from .. import _C
from . import _torch_hooks

_c = _C.caster

_lock = threading.Lock()
_on: set = set()  # idents of the threads with O1 on
# The wrappers are process-wide: installed while anything holds them (a thread with O1 on, an
# open region edit, a checkpoint recomputation of an O1 forward), removed when the last lets go.
_holds: dict = {"n": 0, "table": False}

# ---- the lists (tables in C++; peak.amp.lists is their public face)

CODES = {name: getattr(_c, "POLICY_" + name) for name in (
    "lower", "fp32", "promote", "sequence_promote", "banned", "inplace_fp32", "match_self")}
POLICIES = tuple(CODES)
_defaults_loaded: dict = {"loaded": False}


def ensure_defaults() -> None:
    """Load Apex's O1 lists into the C++ table, once (at the first use of the lists or of O1)."""
    if _defaults_loaded["loaded"]:
        return
    import torch.nn.functional as F  # noqa: PLC0415 (torch.nn is imported by then anyway)
    _defaults_loaded["loaded"] = True
    where = {"torch": torch, "functional": F, "Tensor": torch.Tensor}
    for owner, name, code in _c.default_entries():
        fn = unwrap(getattr(where[owner], name, None))
        if fn is not None and callable(fn):
            _c.set_policy(fn, code)


def set_policies(funcs, code: int) -> None:
    """Give each of ``funcs`` (unwrapped torch callables) the policy ``code`` (0: unlisted),
    process-wide; while the wrappers are installed a newly listed function gets its own now."""
    ensure_defaults()
    for fn in funcs:
        _c.set_policy(fn, code)
    if code and patched():
        with _lock:
            _hold(funcs, counted=False)


def reset() -> None:
    """Back to Apex's O1 lists: every edit and registration dropped."""
    _undo_registrations()
    _pending.clear()
    _c.clear_table()
    _defaults_loaded["loaded"] = False
    ensure_defaults()
    if _holds["table"]:
        with _lock:
            _hold([fn for fn, _code in _c.table()], counted=False)


def is_interceptable(fn) -> bool:
    """Whether calls of ``fn`` can reach the caster (a callable of torch's indexed namespaces)."""
    return id(unwrap(fn)) in index()


# ---- list-edit frames (this thread's; C++ frames on top of the process-wide table)

_frames = threading.local()  # .stack: this thread's open frames, (codes, device_type)
_INPUT_ONLY = ("batch_norm", "instance_norm")  # region edits cast the input only (stats in place)


def _stack() -> list:
    return _frames.__dict__.setdefault("stack", [])


def push_edits(codes: dict, device_type: str | None = None) -> None:
    """Open a list-edit frame in this thread: ``codes`` ({unwrapped callable: code, 0 for
    unlisted}) win over outer frames and the table until ``pop_edits()``. ``device_type=None``:
    an O1 edit (``lists.local``), acting where O1 casts; else a region edit of
    ``peak.amp.autocast`` for that device type (docs/caster.md, "Region list edits")."""
    ensure_defaults()
    input_only = [f for f in codes if getattr(f, "__name__", None) in _INPUT_ONLY]
    _c.push_local(codes, device_type, input_only)
    _stack().append((codes, device_type))
    if device_type is not None or threading.get_ident() in _on:
        with _lock:
            _hold(codes, counted=device_type is not None)


def pop_edits() -> None:
    """Close this thread's innermost list-edit frame."""
    _codes, device_type = _stack().pop()
    _c.pop_local()
    if device_type is not None:
        with _lock:
            _release()


def open_edits(device_type: str) -> list:
    """This thread's open region edits for ``device_type``, outermost first (their codes)."""
    return [codes for codes, device in _stack() if device == device_type]


def functions_named(name: str) -> list:
    """torch's indexed callables named ``name`` (``"exp"``: ``torch.exp``, ``Tensor.exp``)."""
    index()
    return _named.get(name, [])


# ---- user functions (Apex's decorators and registrations)

def decorator(policy: str):
    """The decorator that runs a function under ``policy`` while O1 casts (amp.half_function)."""
    code = CODES[policy]

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return _c.call(code, fn, args, kwargs or None)
        wrapper.__peak_cast_policy__ = policy
        return wrapper
    return decorate


_pending: list = []  # (module, name, policy), applied by the next enable (as Apex)
_applied: list = []  # (module, name, policy, had, own, original, previous code): undone on disable


def register(module, name: str, policy: str) -> None:
    """Have the next ``enable`` patch ``module.name`` (checked by lists.register_*_function)."""
    _pending.append((module, name, policy))


_REGISTER_NAMES = {"lower": "half", "fp32": "float", "promote": "promote"}


def _apply_registrations() -> None:
    """Patch each registered ``module.name`` with the policy's wrapper and list the original, so
    that the registration wins over the built-in lists (Apex: user casts run innermost)."""
    for module, name, policy in list(_pending):  # all checked before any is applied
        if not callable(getattr(module, name, None)):  # changed since it was registered
            _pending.remove((module, name, policy))
            raise TypeError(f"register_{_REGISTER_NAMES[policy]}_function: {module!r}.{name} is "
                            f"no longer a function; that registration is dropped")
    while _pending:
        module, name, policy = _pending.pop(0)
        had, own = name in vars(module), vars(module).get(name)
        # The descriptor itself, also when a class inherits it (None: found only through a
        # metaclass __getattr__). A class's static/class methods stay what they are (wrapping what
        # getattr returns would make a staticmethod an instance method, bind a classmethod).
        raw = inspect.getattr_static(module, name, None) if isinstance(module, type) else own
        descriptor = isinstance(raw, (staticmethod, classmethod))
        orig = raw.__func__ if descriptor else getattr(module, name)
        new = decorator(policy)(orig)
        _applied.append((module, name, policy, had, own, orig, _c.get_policy(orig)))
        _c.set_policy(orig, CODES[policy])
        setattr(module, name, type(raw)(new) if descriptor else new)


def _undo_registrations() -> None:
    """Restore the registered functions (O1 off: plain behaviour), keeping the registrations for
    the next O1 initialize: Apex's patches, once made, stayed for every later initialize."""
    while _applied:
        module, name, policy, had, raw, orig, code = _applied.pop()
        _restore(module, name, had, raw)  # the very object that was there (descriptor included)
        _c.set_policy(orig, code)
        _pending.insert(0, (module, name, policy))


# ---- on / off

def enable(low_dtype: torch.dtype, allow_banned: bool = False) -> None:
    """Turn O1 casting on in this thread with ``low_dtype`` (torch.float16 or torch.bfloat16) as
    the lower precision; ``allow_banned=True`` lets banned functions run (in fp32), not raise."""
    if low_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"low_dtype must be torch.float16 or torch.bfloat16, got {low_dtype}")
    disable()
    ensure_defaults()
    index()  # before anything is patched
    with _lock:
        _apply_registrations()
        # the table, and the list-edit frames entered before O1
        _hold([fn for codes, _device in _stack() for fn in codes], table=True)
        _torch_hooks.install(under_current_state)
        _on.add(threading.get_ident())
    _c.set_low_dtype(low_dtype)
    _c.set_allow_banned(bool(allow_banned))
    _c.set_thread_active(True)
    _c.clear_cache()


def disable() -> None:
    """Turn O1 casting off in this thread (not in others). When no thread has O1 on any more,
    plain behaviour is restored exactly (wrappers and registrations removed)."""
    _c.set_thread_active(False)  # from here on this thread's calls go straight through
    _c.set_low_dtype(None)
    _c.set_allow_banned(False)
    _c.clear_cache()
    alive = {t.ident for t in threading.enumerate()}
    with _lock:  # this thread, and threads that ended with O1 on
        for ident in [t for t in _on if t == threading.get_ident() or t not in alive]:
            _on.discard(ident)
            _release()
        if not _on:
            _torch_hooks.remove()
            _undo_registrations()


def under_current_state(fn):
    """``fn``, to be run later under the caster state in effect now, as torch's checkpoint
    re-enters the forward's autocast state (NOTE: [Checkpoint recomputation] in
    csrc/caster/state.cpp); it holds the wrappers it needs, even after O1 was left everywhere."""
    state = _c.snapshot()
    funcs = [f for codes, _device in _stack() for f in codes]
    table = bool(_on)

    def run(*args, **kwargs):  # (not wraps(fn): fn may be a module, and its __dict__ large)
        _c.push_state(state)
        with _lock:
            _hold(funcs, table=table)
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                _release()
            _c.pop_state()
    return run


# ---- the wrappers (callers hold _lock)

def _hold(funcs=(), table: bool = False, counted: bool = True) -> None:
    """Patch ``funcs`` (and the whole table); ``counted``: as a holder, until ``_release()``."""
    _holds["n"] += counted
    _torch_hooks.install(under_current_state, o1=False)  # (once: while anything holds)
    if table and not _holds["table"]:
        for fn, _code in _c.table():
            _patch(fn)
        _holds["table"] = True
    for fn in funcs:
        _patch(fn)


def _release() -> None:
    _holds["n"] -= 1
    if _holds["n"] == 0:
        _torch_hooks.remove(o1=False)
        while _patched:
            _restore(*_patched.pop())
        _patched_ids.clear()
        _holds["table"] = False


_sites: dict = {}  # id(callable) -> [(owner, name)] where torch code finds it
_named: dict = {}  # name -> [callable], see functions_named
_patched: list = []  # (owner, name, had_own_attribute, previous value), in patch order
_patched_ids: set = set()
_RNN = ("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell",
        "rnn_relu_cell")


def index() -> dict:
    """Where each callable of torch's public namespaces lives (built once, before any patching)."""
    if _sites:
        return _sites
    import torch.nn.functional as F  # noqa: PLC0415
    # torch._C._nn last, and only for what lives nowhere else (F.interpolate calls its
    # upsample_nearest2d): pickle finds a builtin such as F.gelu by its __module__ (torch._C._nn),
    # so patching it there would make a model holding F.gelu unpicklable while O1 is on.
    for owner in (torch, F, torch.Tensor, torch.linalg, torch.special, torch.fft, torch.sparse,
                  torch._C._nn):
        for name in dir(owner):
            try:
                obj = getattr(owner, name)
            except Exception:  # noqa: BLE001 (some attributes raise on access)
                continue
            if owner is torch._C._nn and id(obj) in _sites:
                continue
            if callable(obj) and not isinstance(obj, type):
                _sites.setdefault(id(obj), []).append((owner, name))
                own_name = getattr(obj, "__name__", None)
                for key in {name, own_name if isinstance(own_name, str) else name}:
                    same = _named.setdefault(key, [])
                    if not any(o is obj for o in same):
                        same.append(obj)
    for name in _RNN:  # nn.LSTM & co. call torch._VF.<name> (a module forwarding to torch._C)
        obj = getattr(torch._C._VariableFunctions, name, None)
        if obj is not None:
            _sites.setdefault(id(obj), []).append((torch._VF, name))
    return _sites


def _patch(fn) -> None:
    """Put a C++ wrapper of ``fn`` at each place torch code looks it up (if any is known)."""
    if id(fn) in _patched_ids:
        return
    # The index is keyed by id(): keep only the sites that still hold this very object.
    sites = [(o, n) for o, n in index().get(id(fn), []) if unwrap(getattr(o, n, None)) is fn]
    if not sites:
        return
    _patched_ids.add(id(fn))
    wrapper = _c.wrap(fn)  # NOTE: [Patch wrapper objects] in csrc/caster/caster.cpp
    functools.update_wrapper(wrapper, fn)
    for owner, name in sites:
        own = owner.__dict__ if isinstance(owner, type) else vars(owner)
        had, prev = name in own, own.get(name)
        setattr(owner, name, _c.instancemethod(wrapper) if isinstance(owner, type) else wrapper)
        _patched.append((owner, name, had, prev))


def _restore(owner, name: str, had: bool, prev) -> None:
    """Put back what ``owner.name`` was: ``prev`` if it had its own attribute, else nothing."""
    if had:
        setattr(owner, name, prev)
    else:
        delattr(owner, name)  # it was inherited or found through __getattr__


def patched() -> bool:
    """Whether the caster's wrappers are installed (some thread casts, or has a region edit)."""
    return bool(_patched)


# The C++ caster's own: ``unwrap(obj)`` (``obj``, or the torch callable behind a wrapper);
# ``is_enabled()`` (O1 casts in this thread now), ``low_dtype()`` (the dtype O1 casts to); this
# thread's weight-cast cache (``scale_loss`` exit clears it, as Apex) and its counters (hits,
# casts, stores, size).
unwrap = _c.unwrap
is_enabled = _c.is_casting
low_dtype = _c.low_dtype
clear_cache = _c.clear_cache
cache_stats = _c.cache_stats


@contextlib.contextmanager
def disabled():
    """Run the body without O1 casts (``amp.disable_casts``; exception safe, unlike Apex's)."""
    _c.suspend()
    try:
        yield
    finally:
        _c.resume()


@contextlib.contextmanager
def resumed():
    """Inside ``disabled()``: the body with the casts that were on before it (a closure that an
    optimizer's step calls, the step itself running without casts)."""
    _c.resume()
    try:
        yield
    finally:
        _c.suspend()
