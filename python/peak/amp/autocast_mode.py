"""``peak.amp.autocast`` (a ``torch.autocast`` subclass), ``custom_fwd`` and ``custom_bwd``:
torch.amp's autocast API, plus per-region edits of the op lists (``fp32_ops``/``lower_ops``, a
list-edit frame on the O1 caster). See docs/torch_dialect.md and docs/caster.md."""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable

import torch

from torch.amp.autocast_mode import _cast  # torch's cast of custom_fwd's inputs, as torch's

from .. import _C, _dtypes
from ..torch_releases import (TORCH_AUTOCAST_LIST_CHANGES, autocast_list_changes,
                              cuda_lists_as_of_2_13)
from . import _caster

__all__ = ["autocast", "custom_fwd", "custom_bwd", "TORCH_AUTOCAST_LISTS",
           "TORCH_AUTOCAST_LIST_CHANGES", "autocast_list_changes"]


#: The CPU lists' lower-precision and promote ops: torch exposes which ops have an AutocastCPU
#: kernel, not their policy (docs/caster.md, "torch's autocast lists"); the others are fp32.
_CPU_NOT_FP32 = {"lower_precision_fp": (
        "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding",
        "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "_addmm_activation", "addbmm",
        "linear", "_convolution.deprecated", "matmul", "conv_tbc", "mkldnn_rnn_layer",
        "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "prelu",
        "scaled_dot_product_attention", "_native_multi_head_attention"),
    "promote": ("stack", "cat", "index_copy")}


def _torch_lists() -> dict:
    """torch 2.13's autocast op lists (aten ``op[.overload]`` names) by device type (``"cuda"``'s
    also serve XPU, MTIA, MAIA) and policy, another release's recorded changes undone
    (docs/caster.md, "torch's autocast lists")."""
    cuda = {policy: tuple(ops) for policy, ops in _C.caster.torch_autocast_lists().items()}
    cuda["lower_precision_fp"] += ("cudnn_convolution", "cudnn_convolution_transpose")
    cuda["banned"] = ("binary_cross_entropy",)
    cuda = cuda_lists_as_of_2_13(cuda)  # the header is the installed release's
    changes = autocast_list_changes(device="cpu") or {}
    registered = {name[len("aten::"):] for name in torch._C._dispatch_get_all_op_names()
                  if name.startswith("aten::")
                  and torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCPU")}
    registered = (registered - set(changes.get("added", ()))) | set(changes.get("removed", ()))
    named = {op for ops in _CPU_NOT_FP32.values() for op in ops}
    cpu = {**_CPU_NOT_FP32, "fp32": tuple(sorted(registered - named))}
    return {"cpu": cpu, "cuda": cuda}


def __getattr__(name: str):
    """``TORCH_AUTOCAST_LISTS`` (see ``_torch_lists``), read from torch on first use."""
    if name == "TORCH_AUTOCAST_LISTS":
        return globals().setdefault(name, _torch_lists())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Operator methods that run the op of another name: "matmul" also covers ``a @ b``.
_DUNDERS = {"matmul": ("__matmul__", "__rmatmul__"), "add": ("__add__", "__radd__"),
            "sub": ("__sub__", "__rsub__"), "mul": ("__mul__", "__rmul__"),
            "div": ("__truediv__", "__rtruediv__"), "pow": ("__pow__", "__rpow__")}
_ALIASES = {dunder: op for op, dunders in _DUNDERS.items() for dunder in dunders}


def _op_name(arg: str, entry) -> str:
    """The op name an ``fp32_ops`` / ``lower_ops`` entry stands for ("aten::mm.default": "mm")."""
    if isinstance(entry, str):
        key, what = entry.split("::")[-1].split(".")[0], repr(entry)
    elif callable(entry):
        key = getattr(_caster.unwrap(entry), "__name__", None)
        what = getattr(entry, "__qualname__", None) or repr(entry)
    else:
        raise TypeError(f"autocast: {arg} entries must be torch functions (torch.mm, "
                        f"torch.nn.functional.linear, torch.Tensor.exp) or their names ('mm'), "
                        f"got {type(entry).__name__} {entry!r:.60}")
    key = _ALIASES.get(key, key) if isinstance(key, str) else None
    if key is None or not _caster.functions_named(key):
        raise ValueError(f"autocast: {arg} entry {what} is not a torch function or Tensor method; "
                         f"list edits apply to functions of torch, torch.Tensor, "
                         f"torch.nn.functional, torch.linalg, torch.special and torch.fft "
                         f"(e.g. torch.mm or 'mm', torch.nn.functional.linear or 'linear')")
    return key


def _edit_codes(fp32_ops, lower_ops) -> dict | None:
    """{torch callable: caster policy code} for the region's edits, or None without edits."""
    names: dict[str, str] = {}
    for arg, entries, policy in (("fp32_ops", fp32_ops, "fp32"), ("lower_ops", lower_ops, "lower")):
        if entries is None:
            continue
        if isinstance(entries, (str, bytes)) or not isinstance(entries, Iterable):
            raise TypeError(f"autocast: {arg} must be a list of torch functions or names, got "
                            f"{type(entries).__name__}; wrap a single op in a list: {arg}=[...]")
        for entry in entries:
            key = _op_name(arg, entry)
            if names.setdefault(key, policy) != policy:
                raise ValueError(f"autocast: op {key!r} is in both fp32_ops and lower_ops; "
                                 f"put it in one of them")
    return {fn: _caster.CODES[policy] for key, policy in names.items()
            for name in (key,) + _DUNDERS.get(key, ()) for fn in _caster.functions_named(name)
            } or None


_COMPILED_EDITS = (
    "peak.amp.autocast(fp32_ops=..., lower_ops=...) in code that torch.compile traces: Dynamo "
    "runs torch's autocast in its place, which would drop the list edits. Open the region "
    "outside the compiled code (with peak.amp.autocast(...): compiled_model(x)), or keep the "
    "region's code out of the compile (torch.compiler.disable)")


class autocast(torch.amp.autocast_mode.autocast):
    """``torch.autocast(device_type, dtype=None, enabled=True, cache_enabled=None)``, as a context
    manager or decorator, plus per-region list edits.

    ``dtype`` also takes peak's dtype strings (``"bf16"``, ``"fp16"``, ...). ``fp32_ops`` /
    ``lower_ops``: torch functions (``torch.mm``, ``torch.Tensor.exp``) or their names (``"mm"``)
    to run in float32 / in ``dtype`` inside this region, over torch's lists; nested regions
    inherit them, the innermost wins (docs/torch_dialect.md, "List edits").
    """

    # NOTE: [Regions under torch.compile] Dynamo traces torch's autocast (it keeps the region in
    # the graph) but not a subclass created in the traced code, whose state changes it refuses.
    # There a region without edits is torch's own; one with edits is refused (Dynamo would run
    # torch's autocast for it, read from the attributes below, and drop the edits silently).
    def __new__(cls, *args, **kwargs):  # (copy and pickle call it without arguments)
        if torch.compiler.is_compiling():
            if kwargs.get("fp32_ops") is not None or kwargs.get("lower_ops") is not None:
                raise RuntimeError(_COMPILED_EDITS)
            if cls is autocast:
                return _torchs_autocast(*args, **kwargs)
        return super().__new__(cls)

    @property
    def _enabled(self) -> bool:
        if self.__dict__.get("_edits") is not None and (  # (Dynamo reads it, made outside)
                torch.compiler.is_compiling() or torch._guards.TracingContext.try_get()):
            raise RuntimeError(_COMPILED_EDITS)
        return self.__dict__["_enabled_value"]

    @_enabled.setter
    def _enabled(self, value: bool) -> None:
        self.__dict__["_enabled_value"] = value

    def __init__(self, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                 cache_enabled: bool | None = None, *, fp32_ops: Iterable | None = None,
                 lower_ops: Iterable | None = None) -> None:
        # torch.dtype objects go to torch as they are (torch decides what it supports)
        dtype = _dtypes.parse_dtype(dtype, "autocast: dtype", any_dtype=True)
        if not isinstance(enabled, bool):
            raise TypeError(f"autocast: enabled must be a bool, got {type(enabled).__name__}")
        if cache_enabled is not None and not isinstance(cache_enabled, bool):
            raise TypeError(f"autocast: cache_enabled must be a bool or None, got "
                            f"{type(cache_enabled).__name__}")
        super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        if getattr(self, "_enabled", enabled):  # torch turns itself off for dtypes it lacks
            _dtypes.warn_if_slow_fp16(self.fast_dtype, self.device,
                                      fix='dtype=torch.bfloat16 (or "bf16")')
        self._edits = _edit_codes(fp32_ops, lower_ops)
        self._saved: list = []

    def __enter__(self):
        if self._edits is not None and torch.compiler.is_compiling():
            raise RuntimeError(_COMPILED_EDITS)
        super().__enter__()
        if self._edits is not None:
            _caster.push_edits(self._edits, self.device)
        # torch keeps the previous state in attributes; a stack makes the instance reentrant
        # (a recursive function decorated with one autocast instance).
        self._saved.append((self.prev, self.prev_fastdtype, self.prev_cache_enabled,
                            self._edits is not None))
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any):
        self.prev, self.prev_fastdtype, self.prev_cache_enabled, edited = self._saved.pop()
        if edited:
            _caster.pop_edits()
        return super().__exit__(exc_type, exc_val, exc_tb)

    def __call__(self, func):
        # torch checks this itself from 2.12 on; before, a non-callable became a broken wrapper.
        if not callable(func) and not torch.jit.is_scripting():
            raise TypeError(f"autocast()(func) requires a callable, but got {type(func).__name__}"
                            f"; as a context manager: with peak.amp.autocast(device_type=...): ...")
        return super().__call__(func)


def _torchs_autocast(device_type, dtype=None, enabled=True, cache_enabled=None, *,
                     fp32_ops=None, lower_ops=None):
    dtype = _dtypes.parse_dtype(dtype, "autocast: dtype", any_dtype=True)
    return torch.amp.autocast_mode.autocast(device_type, dtype=dtype, enabled=enabled,
                                            cache_enabled=cache_enabled)


def _check_device_type(device_type) -> None:
    if not isinstance(device_type, str):
        raise ValueError(f"Expected `device_type` of type `str`, got: `{type(device_type)}`")


def custom_fwd(fwd: Callable | None = None, *, device_type: str,
               cast_inputs: torch.dtype | None = None):
    """``torch.amp.custom_fwd``: decorator for ``forward`` of a ``torch.autograd.Function``.

    ``cast_inputs=None``: ``forward`` runs under the current autocast state (and peak's list
    edits). ``cast_inputs=dtype`` (a torch.dtype, or a string such as ``"fp32"``, ``"bf16"``):
    inside an autocast-enabled region, floating tensors on ``device_type`` (not float64; also
    inside lists, tuples, dicts and other iterables) are cast to ``dtype`` and ``forward`` runs
    with autocast (and so peak's list edits) off; outside such a region it is a no-op. Records the
    state for ``custom_bwd`` on ``ctx``."""
    _check_device_type(device_type)
    if cast_inputs in (float, int, bool, complex):
        # torch takes Python's types where it takes dtypes (Tensor.to(float) is float64)
        cast_inputs = {float: torch.float64, int: torch.int64, bool: torch.bool,
                       complex: torch.complex128}[cast_inputs]
    cast_inputs = _dtypes.parse_dtype(cast_inputs, "custom_fwd: cast_inputs", _dtypes.FLOATING,
                                      any_dtype=True)
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device_type, cast_inputs=cast_inputs)
    if not callable(fwd):
        raise TypeError(f"custom_fwd: expected the forward function to decorate, got "
                        f"{type(fwd).__name__}")

    @functools.wraps(fwd)
    def decorate_fwd(*args, **kwargs):
        ctx = args[0]
        ctx._dtype = torch.get_autocast_dtype(device_type)
        enabled = torch.is_autocast_enabled(device_type)
        if cast_inputs is None:
            ctx._fwd_used_autocast = enabled
            ctx._peak_edits = _caster.open_edits(device_type) if enabled else []
            # O1's state too (on, or off in disable_casts) where O1 is on (Dynamo: it stands down)
            o1_state = _caster.patched() and not torch.compiler.is_compiling()
            ctx._peak_o1_state = (_caster.under_current_state(lambda fn, *a, **k: fn(*a, **k))
                                  if o1_state else None)
            return fwd(*args, **kwargs)
        ctx._fwd_used_autocast = False
        ctx._peak_edits = []
        o1 = _caster.patched() and _caster.is_enabled()  # O1 stands down (Dynamo: patched())
        ctx._peak_o1_off = o1 or _caster.patched()  # (and in backward, wherever that runs)
        if enabled or o1:  # (no ExitStack: Dynamo keeps an autocast region only in a with)
            none = contextlib.nullcontext
            with (autocast(device_type=device_type, enabled=False) if enabled else none()), \
                    (_caster.disabled() if o1 else none()):
                return fwd(*_cast(args, device_type, cast_inputs),
                           **_cast(kwargs, device_type, cast_inputs))
        return fwd(*args, **kwargs)
    return decorate_fwd


def custom_bwd(bwd: Callable | None = None, *, device_type: str):
    """``torch.amp.custom_bwd``: runs ``backward`` of a ``torch.autograd.Function`` under the
    autocast state its ``custom_fwd``-decorated ``forward`` saw (enabled, dtype, list edits)."""
    _check_device_type(device_type)
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device_type)
    if not callable(bwd):
        raise TypeError(f"custom_bwd: expected the backward function to decorate, got "
                        f"{type(bwd).__name__}")

    @functools.wraps(bwd)
    def decorate_bwd(*args, **kwargs):
        ctx = args[0]
        if not hasattr(ctx, "_fwd_used_autocast"):
            # AttributeError, as torch's custom_bwd raises reading the missing attribute.
            raise AttributeError("custom_bwd: forward was not decorated with custom_fwd (peak's "
                                 "or torch's), or takes no ctx (setup_context: custom_fwd records "
                                 "the state on ctx): decorate both, forward taking ctx first")
        # The forward's open edits, outer first: inner edits win.
        edits = {fn: code for codes in getattr(ctx, "_peak_edits", [])
                 for fn, code in codes.items()} or None
        forward_state = {"device_type": device_type, "enabled": ctx._fwd_used_autocast,
                         "dtype": ctx._dtype}
        if edits:  # (peak's region even where Dynamo traces, compiled autograd: it refuses it)
            region = object.__new__(autocast)
            region.__init__(**forward_state)
            region._edits = edits
        else:
            region = torch.amp.autocast_mode.autocast(**forward_state)
        with region, (_caster.disabled() if getattr(ctx, "_peak_o1_off", False)
                      else contextlib.nullcontext()):  # (compiled autograd: no snapshot below)
            run_o1 = None if torch.compiler.is_compiling() else getattr(ctx, "_peak_o1_state", None)
            return bwd(*args, **kwargs) if run_o1 is None else run_o1(bwd, *args, **kwargs)

    return decorate_bwd
