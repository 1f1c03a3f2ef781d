"""``peak.amp.lists``: the O1 caster's op lists (torch callable -> policy; Apex's O1 lists by
default), editable at run time: in every thread, persisting across ``amp.initialize``; ``local``
edits one thread and one block. See docs/caster.md, "Editing the lists"."""

from __future__ import annotations

import contextlib

import torch

from .. import _C
from . import _caster

_c = _C.caster

__all__ = ["POLICIES", "add", "remove", "local", "policy_of", "entries", "set_allow_banned",
           "reset", "set_dispatch", "half_function", "float_function", "promote_function",
           "register_half_function", "register_float_function", "register_promote_function"]

_NAMES = {code: name for name, code in _caster.CODES.items()}
#: The policy names ``add`` accepts.
POLICIES = _caster.POLICIES
_unwrap = _caster.unwrap


def _code(policy, fn=None) -> int:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(map(repr, POLICIES))}, got {policy!r}")
    name = getattr(fn, "__name__", "")  # (exp_, add_: in place; a table entry may come again)
    if policy not in ("match_self", "inplace_fp32") and name[-1:] == "_" != name[-2:-1] and (
            _c.get_policy(_unwrap(fn)) != _caster.CODES[policy]):
        raise ValueError(f"{name} writes its own tensor, which {policy!r} would cast and lose "
                         f"the write: give it 'match_self' or 'inplace_fp32', or list {name[:-1]}")
    return _caster.CODES[policy]


def _check_callable(fn, arg: str = "func", *, torch_own: bool = False) -> None:
    if not callable(fn):
        raise TypeError(f"{arg} must be a callable (e.g. torch.nn.functional.gelu, torch.mm, "
                        f"torch.Tensor.add), got {type(fn).__name__}: {fn!r}")
    if isinstance(getattr(fn, "__self__", None), torch.Tensor):
        # x.relu is a new bound object at every attribute access: no call could ever match it.
        raise TypeError(f"{arg} is a method bound to one tensor ({fn!r}); list the unbound "
                        f"method instead, e.g. torch.Tensor.{getattr(fn, '__name__', 'relu')}")
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        raise TypeError(f"{arg} is an aten op ({fn}); the O1 lists take the Python-level torch "
                        f"functions that code calls (e.g. torch.sigmoid, torch.Tensor.sigmoid, "
                        f"torch.nn.functional.sigmoid)")
    if torch_own and not _caster.is_interceptable(fn):
        # Only torch's own callables are looked up in the lists: a function of the user's (or a
        # module class) never reaches the caster, so listing it would silently do nothing.
        raise TypeError(f"{arg} {getattr(fn, '__qualname__', fn)!r} is not a function of torch, "
            "torch.nn.functional, torch.Tensor, torch.linalg, torch.special, torch.fft or "
            "torch.sparse, so O1 never sees its calls. For your own functions use the decorators "
            "amp.half_function / amp.float_function / amp.promote_function, or "
            "amp.register_half_function(module, name) (and register_float/promote_function) "
            "before amp.initialize; for a module (e.g. nn.GELU) list the function it calls "
            "(torch.nn.functional.gelu).")


def add(policy: str, *funcs) -> None:
    """Give each of ``funcs`` the ``policy`` (replacing any policy it had)."""
    code = _code(policy)
    if not funcs:
        raise TypeError("lists.add(policy, *funcs): pass at least one function, "
                        "e.g. lists.add('fp32', torch.nn.functional.gelu)")
    for fn in funcs:
        _check_callable(fn, torch_own=True)
        _code(policy, fn)
    _caster.set_policies([_unwrap(fn) for fn in funcs], code)


def remove(*funcs) -> None:
    """Take each of ``funcs`` off the lists (it then runs in whatever dtypes it receives)."""
    if not funcs:
        raise TypeError("lists.remove(*funcs): pass at least one function, "
                        "e.g. lists.remove(torch.nn.functional.softmax)")
    _caster.ensure_defaults()
    funcs = [_unwrap(fn) for fn in funcs]
    for fn in funcs:
        _check_callable(fn)
        if _c.get_policy(fn) == 0:
            raise ValueError(f"{fn!r} is on no O1 list; lists.policy_of(func) tells where a "
                             "function is")
    _caster.set_policies(funcs, 0)


def policy_of(func) -> str | None:
    """The policy name of ``func`` in this thread (``local`` edits first; a ``register_*_function``
    patch or an ``amp.half_function``-style decorator: its own), or None if unlisted."""
    _check_callable(func)
    if getattr(func, "__peak_cast_policy__", None):
        return func.__peak_cast_policy__
    _caster.ensure_defaults()
    return _NAMES.get(_c.effective_policy(_unwrap(func)))  # (0, unlisted: None)


@contextlib.contextmanager
def local(edits: dict):
    """Edit the lists for this thread only, inside the ``with`` block::

        with lists.local({F.gelu: "lower", F.softmax: None}):   # None: on no list here
            ...

    Inner blocks win over outer ones, and both over the process-wide lists; other threads are
    not affected."""
    if not isinstance(edits, dict):
        raise TypeError(f"edits must be a dict {{function: policy name or None}}, got "
                        f"{type(edits).__name__}")
    codes = {}
    for fn, policy in edits.items():
        _check_callable(fn, "edits key", torch_own=True)
        codes[_unwrap(fn)] = 0 if policy is None else _code(policy, fn)
    _caster.push_edits(codes)
    try:
        yield
    finally:
        _caster.pop_edits()


def entries() -> dict:
    """Every listed callable and its policy name."""
    _caster.ensure_defaults()
    return {fn: _NAMES[code] for fn, code in _c.table()}


reset = _caster.reset


def set_dispatch(dispatch: str) -> None:
    """Kept for earlier peak's scripts: takes only ``"patch"``, O1's one dispatch."""
    if dispatch != "patch":  # (the TorchFunctionMode dispatch 'mode' was removed)
        raise ValueError(f"lists.set_dispatch({dispatch!r}): dispatch must be 'patch' (O1's only "
                         "one: docs/caster.md, 'One dispatch'; 'mode' was removed). Delete the "
                         "call")


def set_allow_banned(allow: bool) -> None:
    """Let banned functions (binary_cross_entropy) run in fp32 instead of raising (Apex's
    ``allow_banned``) in this thread, until O1 is next enabled (``amp.initialize`` sets it from its
    own ``allow_banned`` argument: pass it there to have it from the start)."""
    if allow not in (True, False):
        raise TypeError(f"allow must be True or False, got {allow!r}")
    _c.set_allow_banned(bool(allow))


# ---- user functions (Apex's decorators and registrations)

def _decorator(policy: str, doc: str):
    cast = _caster.decorator(policy)

    def decorate(fn):
        _check_callable(fn, "fn")
        return cast(fn)
    decorate.__doc__ = "Decorator: under O1, " + doc
    return decorate


half_function = _decorator("lower", "cast the function's floating arguments to the low dtype "
                           "(fp16/bf16) before calling it; otherwise call it unchanged.")
float_function = _decorator("fp32", "cast the function's floating arguments to float32.")
promote_function = _decorator("promote", "if the floating arguments mix precisions, cast them "
                              "all to float32.")


def _register(module, name, policy: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str (the attribute name), got {type(name).__name__}")
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")
    if not callable(getattr(module, name)):
        raise TypeError(f"{module!r}.{name} is a {type(getattr(module, name)).__name__}, not a "
                        "function: register_*_function takes the name of a function to cast the "
                        "arguments of")
    if _caster.is_interceptable(getattr(module, name)):  # (torch's own: its in-place names)
        _code(policy, getattr(module, name))
    _caster.register(module, name, policy)


def _registration(kind: str, policy: str, doc: str):
    def register(module, name) -> None:
        _register(module, name, policy)
    register.__name__ = register.__qualname__ = f"register_{kind}_function"
    register.__doc__ = "Before ``amp.initialize``: under O1, " + doc
    return register


register_half_function = _registration("half", "lower",
                                       "run ``module.name`` with low-precision arguments.")
register_float_function = _registration("float", "fp32",
                                        "run ``module.name`` with float32 arguments.")
register_promote_function = _registration("promote", "promote", "promote ``module.name``'s "
                                          "mixed-precision arguments.")
