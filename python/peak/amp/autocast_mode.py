"""``peak.amp.autocast``, ``custom_fwd`` and ``custom_bwd``: torch.amp's autocast API, plus
per-region edits of the op lists.

``autocast`` *is* ``torch.autocast`` underneath (a subclass that enters it), so
``torch.is_autocast_enabled()``, ``torch.utils.checkpoint``, ``custom_fwd`` and the weight-cast
cache behave exactly as with torch. ``fp32_ops=[...]`` / ``lower_ops=[...]`` move torch functions
into torch's "fp32" or "lower precision" policy inside the region only: a ``TorchFunctionMode``
casts the eligible arguments of a listed function (floating point, not float64, on the region's
device type) to float32 or to the region's dtype and calls it with torch's autocast off for that
device type, so torch does not re-cast them. Edits act where autocast for that device type is on
inside the region (an inner ``autocast(enabled=False)`` or ``custom_fwd(cast_inputs=...)`` turns
them off too). See docs/torch_dialect.md.

(The C++ caster of the O1 issue does not exist yet; when it does, the edits can move there. The
lists below are torch's, as registered in torch 2.13 -- peak does not change them.)
"""
from __future__ import annotations

import collections.abc
import contextlib
import functools
import threading
from typing import Any, Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode

from .. import _dtypes
from . import _caster

try:
    import numpy as _np
except ModuleNotFoundError:  # pragma: no cover
    _np = None

__all__ = ["autocast", "custom_fwd", "custom_bwd", "TORCH_AUTOCAST_LISTS", "TORCH_AUTOCAST_LIST_CHANGES"]

#: torch 2.13's autocast op lists (aten op[.overload] names), by device type and cast policy.
#: Read from torch's source (aten/src/ATen/autocast_mode.cpp); tests/torch_dialect checks them against
#: the kernels registered on the AutocastCPU / AutocastCUDA dispatch keys.
TORCH_AUTOCAST_LISTS = {
    "cpu": {
        "lower_precision_fp": (
            'conv1d', 'conv1d.padding', 'conv2d', 'conv2d.padding', 'conv3d', 'conv3d.padding',
            'bmm', 'mm', 'linalg_vecdot', 'baddbmm', 'addmm', '_addmm_activation', 'addbmm',
            'linear', '_convolution.deprecated', 'matmul', 'conv_tbc', 'mkldnn_rnn_layer',
            'conv_transpose1d', 'conv_transpose2d.input', 'conv_transpose3d.input', 'prelu',
            'scaled_dot_product_attention', '_native_multi_head_attention',
        ),
        "fp32": (
            '_grid_sampler_2d_cpu_fallback', '_lu_with_info', 'adaptive_avg_pool3d',
            'adaptive_max_pool3d', 'avg_pool3d', 'binary_cross_entropy',
            'binary_cross_entropy_with_logits', 'cdist', 'cholesky', 'cholesky_inverse',
            'cholesky_solve', 'cosine_embedding_loss', 'cross_entropy_loss', 'ctc_loss.IntList',
            'ctc_loss.Tensor', 'fake_quantize_per_tensor_affine', 'fft_fft', 'fft_fft2', 'fft_fftn',
            'fft_hfft', 'fft_ifft', 'fft_ifft2', 'fft_ifftn', 'fft_ihfft', 'fft_irfft',
            'fft_irfft2', 'fft_irfftn', 'fft_rfft', 'fft_rfft2', 'fft_rfftn',
            'fractional_max_pool2d', 'fractional_max_pool3d', 'geqrf', 'grid_sampler',
            'grid_sampler_2d', 'grid_sampler_3d', 'hinge_embedding_loss', 'huber_loss', 'inverse',
            'kl_div', 'l1_loss', 'linalg_cholesky', 'linalg_cholesky_ex', 'linalg_cond',
            'linalg_cond.p_str', 'linalg_eig', 'linalg_eigh', 'linalg_eigvals', 'linalg_eigvalsh',
            'linalg_householder_product', 'linalg_inv', 'linalg_inv_ex', 'linalg_lstsq',
            'linalg_matrix_rank', 'linalg_matrix_rank.atol_rtol_float',
            'linalg_matrix_rank.atol_rtol_tensor', 'linalg_matrix_rank.tol_tensor', 'linalg_qr',
            'linalg_solve', 'linalg_svd', 'linalg_svdvals', 'linalg_tensorinv',
            'linalg_tensorsolve', 'lu_solve', 'margin_ranking_loss', 'max_pool3d', 'max_unpool2d',
            'max_unpool3d', 'mse_loss', 'multi_margin_loss', 'multilabel_margin_loss',
            'multilabel_margin_loss_forward', 'nanquantile', 'nanquantile.scalar', 'nll_loss',
            'nll_loss2d', 'orgqr', 'ormqr', 'pinverse', 'poisson_nll_loss', 'polar', 'prod',
            'prod.dim_int', 'qr', 'quantile', 'quantile.scalar', 'reflection_pad1d',
            'reflection_pad2d', 'replication_pad1d', 'replication_pad2d', 'replication_pad3d',
            'smooth_l1_loss', 'soft_margin_loss', 'stft', 'stft.center', 'svd', 'trace',
            'triangular_solve', 'triplet_margin_loss', 'view_as_complex',
        ),
        "promote": (
            'stack', 'cat', 'index_copy',
        ),
    },
    "cuda": {
        "lower_precision_fp": (
            '_convolution.deprecated', '_convolution', 'conv1d', 'conv2d', 'conv3d', 'conv_tbc',
            'conv_transpose1d', 'conv_transpose2d.input', 'conv_transpose3d.input', 'convolution',
            'prelu', 'addmm', 'addmv', 'addr', 'matmul', 'einsum', 'mm', 'mv', 'linalg_vecdot',
            'linear', 'addbmm', 'baddbmm', 'bmm', 'chain_matmul', 'linalg_multi_dot',
            '_thnn_fused_lstm_cell', '_thnn_fused_gru_cell', 'lstm_cell', 'gru_cell',
            'rnn_tanh_cell', 'rnn_relu_cell', '_scaled_dot_product_flash_attention',
            'scaled_dot_product_attention', 'cudnn_convolution', 'cudnn_convolution_transpose',
        ),
        "fp32": (
            '_upsample_bicubic2d_aa', '_upsample_bilinear2d_aa', '_upsample_nearest_exact1d',
            '_upsample_nearest_exact2d', '_upsample_nearest_exact3d', 'acos', 'asin',
            'binary_cross_entropy_with_logits', 'cdist', 'cosh', 'cosine_embedding_loss',
            'cosine_similarity', 'dist', 'erfinv', 'exp', 'expm1', 'frobenius_norm.dim',
            'group_norm', 'hinge_embedding_loss', 'huber_loss', 'kl_div', 'l1_loss', 'layer_norm',
            'log', 'log10', 'log1p', 'log2', 'logsumexp', 'margin_ranking_loss', 'mse_loss',
            'multi_margin_loss', 'multilabel_margin_loss', 'native_layer_norm', 'nll_loss',
            'nll_loss2d', 'nuclear_norm', 'nuclear_norm.dim', 'pdist', 'poisson_nll_loss',
            'pow.Scalar', 'pow.Tensor_Scalar', 'pow.Tensor_Tensor', 'reciprocal', 'renorm',
            'rms_norm', 'rsqrt', 'sinh', 'smooth_l1_loss', 'soft_margin_loss', 'softplus', 'tan',
            'triplet_margin_loss', 'upsample_bicubic2d', 'upsample_bilinear2d', 'upsample_linear1d',
            'upsample_nearest1d', 'upsample_nearest2d', 'upsample_nearest3d', 'upsample_trilinear3d',
        ),
        "fp32_set_opt_dtype": (
            'prod', 'prod.dim_int', 'softmax.int', 'log_softmax.int', 'cumprod', 'cumsum',
            'linalg_vector_norm', 'linalg_matrix_norm', 'linalg_matrix_norm.str_ord', 'sum',
            'sum.dim_IntList',
        ),
        "fp32_append_dtype": (
            'norm.Scalar', 'norm.ScalarOpt_dim',
        ),
        "promote": (
            'addcdiv', 'addcmul', 'atan2', 'bilinear', 'cross', 'dot', 'vdot', 'grid_sampler',
            'index_put', 'tensordot', 'scatter_add',
        ),
        "banned": (
            'binary_cross_entropy',
        ),
    },
}

#: How other supported torch releases differ from the 2.13 lists above (read off their dispatchers;
#: tests/torch_dialect checks it): ops added to / removed from each device's autocast set.
TORCH_AUTOCAST_LIST_CHANGES = {
    (2, 14): {
        "cpu": {"added": ("linalg_matrix_sqrth",), "removed": ("cholesky", "qr")},
        "cuda": {"added": ("_cudnn_rnn", "linalg_matrix_sqrth"), "removed": ()},
    },
}

_POLICIES = ("fp32", "lower")
# Python-level names that differ from the op they run.
_ALIASES = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__add__": "add", "__radd__": "add",
            "__sub__": "sub", "__rsub__": "sub", "__mul__": "mul", "__rmul__": "mul",
            "__truediv__": "div", "__rtruediv__": "div", "__pow__": "pow", "__rpow__": "pow"}
_NAMESPACES = ("torch", "torch.Tensor", "torch.nn.functional", "torch.linalg", "torch.special",
               "torch.fft")


@functools.lru_cache(maxsize=None)
def _known_names() -> frozenset:
    """Every name a torch function or Tensor method reaches ``__torch_function__`` with."""
    names = set()
    for ns_name in _NAMESPACES:
        ns = functools.reduce(getattr, ns_name.split(".")[1:], torch)
        for attr in dir(ns):
            if attr.startswith("_") and not attr.startswith("__"):
                if attr not in ("_addmm_activation", "_native_multi_head_attention"):
                    continue
            try:
                obj = getattr(ns, attr)
            except Exception:
                continue
            if callable(obj) and not isinstance(obj, type):
                names.add(_ALIASES.get(attr, attr))
                name = getattr(obj, "__name__", None)
                if isinstance(name, str):
                    names.add(_ALIASES.get(name, name))
    for lists in TORCH_AUTOCAST_LISTS.values():
        for ops in lists.values():
            names.update(op.split(".")[0] for op in ops)
    return frozenset(names)


def _op_key(func) -> str | None:
    name = getattr(func, "__name__", None)
    if not isinstance(name, str):
        return None
    return _ALIASES.get(name, name)


def _normalize_entry(arg: str, entry) -> str:
    if isinstance(entry, str):
        key = entry.split("::")[-1].split(".")[0]  # "aten::conv2d.padding" -> "conv2d"
        key = _ALIASES.get(key, key)
        what = repr(entry)
    elif callable(entry):
        key = _op_key(entry)
        what = getattr(entry, "__qualname__", None) or repr(entry)
    else:
        raise TypeError(f"autocast: {arg} entries must be torch functions (torch.mm, "
                        f"torch.nn.functional.linear, torch.Tensor.exp) or their names ('mm'), "
                        f"got {type(entry).__name__} {entry!r:.60}")
    if key is None or key not in _known_names():
        raise ValueError(f"autocast: {arg} entry {what} is not a torch function or Tensor method; "
                         f"list edits apply to functions of torch, torch.Tensor, "
                         f"torch.nn.functional, torch.linalg, torch.special and torch.fft "
                         f"(e.g. torch.mm or 'mm', torch.nn.functional.linear or 'linear')")
    return key


def _build_policy(fp32_ops, lower_ops) -> dict[str, str] | None:
    policy: dict[str, str] = {}
    for arg, entries, action in (("fp32_ops", fp32_ops, "fp32"), ("lower_ops", lower_ops, "lower")):
        if entries is None:
            continue
        if isinstance(entries, (str, bytes)) or not isinstance(entries, Iterable):
            raise TypeError(f"autocast: {arg} must be a list of torch functions or names, "
                            f"got {type(entries).__name__}; wrap a single op in a list: {arg}=[...]")
        for entry in entries:
            key = _normalize_entry(arg, entry)
            if policy.get(key, action) != action:
                raise ValueError(f"autocast: op {key!r} is in both fp32_ops and lower_ops; "
                                 f"put it in one of them")
            policy[key] = action
    return policy or None


# Active list edits of this thread, innermost last: (device_type, policy). custom_fwd records
# them so that custom_bwd can run backward under the same edits.
_tls = threading.local()


def _edit_stack() -> list:
    stack = getattr(_tls, "stack", None)
    if stack is None:
        stack = _tls.stack = []
    return stack


def _eligible(t: torch.Tensor, device_type: str) -> bool:
    return t.is_floating_point() and t.dtype is not torch.float64 and t.device.type == device_type


_INPUT_ONLY = frozenset({"batch_norm", "instance_norm"})


def _write_back(result, copies):
    """The op wrote into cast copies (``out=``, an in-place op, batch norm's running stats):
    copy what it wrote into the caller's tensors, and return those where it returned a copy, so
    that nothing is written to a temporary and lost."""
    written = [(orig, cast) for orig, cast, version in copies if cast._version != version]
    if not written:
        return result
    with torch.no_grad():
        for orig, cast in written:
            orig.copy_(cast)
    back = {id(cast): orig for orig, cast in written}
    if isinstance(result, torch.Tensor):
        return back.get(id(result), result)
    if isinstance(result, (list, tuple)):
        return type(result)(back.get(id(r), r) if isinstance(r, torch.Tensor) else r
                            for r in result)
    return result


class _ListEditMode(TorchFunctionMode):
    """Runs the functions named in ``policy`` under the "fp32" or "lower" cast policy (torch's
    ``CastPolicy::fp32`` / ``lower_precision_fp``), with torch's autocast off for the device type
    during the call so it does not cast them again; everything else passes straight through."""

    def __init__(self, device_type: str, policy: dict[str, str]) -> None:
        super().__init__()
        self.device_type = device_type
        self.policy = policy
        # Lower-precision casts of fp32 leaf parameters, reused inside the region (torch's rule:
        # leaf, requires_grad, not a view, cache enabled, grad mode on), keyed by identity and
        # invalidated by the version counter (an in-place update of the weight).
        self.cache: dict[int, tuple] = {}

    def _cast_tensor(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if t.dtype is dtype or not _eligible(t, self.device_type):
            return t
        cacheable = (dtype is not torch.float32 and t.dtype is torch.float32 and t.requires_grad
                     and t.is_leaf and not t._is_view() and torch.is_autocast_cache_enabled()
                     and torch.is_grad_enabled() and not torch.is_inference_mode_enabled())
        if not cacheable:
            return t.to(dtype)
        hit = self.cache.get(id(t))
        if hit is not None and hit[0] is t and hit[1] == t._version and hit[2].dtype is dtype:
            return hit[2]
        out = t.to(dtype)
        self.cache[id(t)] = (t, t._version, out)
        return out

    def _cast(self, value, dtype, copies):
        """``value`` with its eligible tensors cast; (original, cast) pairs go to ``copies``."""
        if isinstance(value, torch.Tensor):
            out = self._cast_tensor(value, dtype)
            if out is not value:
                copies.append((value, out, out._version))
            return out
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self._cast(v, dtype, copies) if isinstance(v, torch.Tensor) else v
                               for v in value)
        return value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if func in _caster.AUTOGRAD_ENTRIES:
            # backward/grad: the engine (and checkpoint's recomputation) runs with the edits on.
            return _caster.run_autograd_in_mode(self, func, args, kwargs)
        action = self.policy.get(_op_key(func))
        device_type = self.device_type
        if action is None or not torch.is_autocast_enabled(device_type):
            return func(*args, **kwargs)
        dtype = torch.float32 if action == "fp32" else torch.get_autocast_dtype(device_type)
        copies: list = []
        if _op_key(func) in _INPUT_ONLY:
            # Batch/instance norm update their running statistics in place without bumping a
            # version counter: only the input is cast (CPU and CUDA take mixed-dtype statistics).
            if args:
                args = (self._cast(args[0], dtype, copies),) + tuple(args[1:])
            elif "input" in kwargs:
                kwargs = dict(kwargs, input=self._cast(kwargs["input"], dtype, copies))
        else:
            args = tuple(self._cast(a, dtype, copies) for a in args)
            kwargs = {k: self._cast(v, dtype, copies) for k, v in kwargs.items()}
        torch.set_autocast_enabled(device_type, False)
        try:
            result = func(*args, **kwargs)
        finally:
            torch.set_autocast_enabled(device_type, True)
        return _write_back(result, copies)


class autocast(torch.amp.autocast_mode.autocast):
    """``torch.autocast(device_type, dtype=None, enabled=True, cache_enabled=None)``, as a context
    manager or decorator, plus per-region list edits.

    ``dtype`` also takes peak's dtype strings (``"bf16"``, ``"bfloat16"``, ``"fp16"``,
    ``"float16"``, ``"half"``).

    Args:
        fp32_ops: torch functions (``torch.mm``, ``torch.nn.functional.linear``,
            ``torch.Tensor.exp``) or their names (``"mm"``, ``"linear"``, ``"aten::conv2d"``;
            an overload suffix is ignored) to run in float32 inside this region.
        lower_ops: the same, to run in the region's lower-precision ``dtype``.

    A listed op takes precedence over torch's lists (``fp32_ops=["mm"]`` runs ``mm`` in fp32
    under CPU/CUDA autocast). An entry names the function and its Tensor method
    (``torch.mm`` and ``x.mm``; ``"matmul"`` also covers ``@``), not in-place variants. Nested
    regions inherit the edits of outer ones; the innermost edit of an op wins. Edits apply only
    where autocast for ``device_type`` is enabled.
    """

    def __init__(self, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                 cache_enabled: bool | None = None, *, fp32_ops: Iterable | None = None,
                 lower_ops: Iterable | None = None) -> None:
        # torch.dtype objects go to torch as they are (torch decides what it supports); strings
        # ("bf16", "fp16", ...) are read by peak's one dtype parser.
        dtype = _dtypes.parse_dtype(dtype, "autocast: dtype", any_dtype=True)
        if not isinstance(enabled, bool):
            raise TypeError(f"autocast: enabled must be a bool, got {type(enabled).__name__}")
        if cache_enabled is not None and not isinstance(cache_enabled, bool):
            raise TypeError(f"autocast: cache_enabled must be a bool or None, got "
                            f"{type(cache_enabled).__name__}")
        super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)
        if getattr(self, "_enabled", enabled):  # torch turns itself off for dtypes it lacks
            _dtypes.warn_if_slow_fp16(self.fast_dtype, self.device, fix='dtype=torch.bfloat16 (or "bf16")')
        self._policy = _build_policy(fp32_ops, lower_ops)
        self._saved: list = []

    def __enter__(self):
        super().__enter__()
        mode = None
        if self._policy is not None:
            mode = _ListEditMode(self.device, self._policy)
            mode.__enter__()
            _edit_stack().append((self.device, self._policy))
        # torch keeps the previous state in attributes; a stack makes the instance reentrant
        # (a recursive function decorated with one autocast instance).
        self._saved.append((self.prev, self.prev_fastdtype, self.prev_cache_enabled, mode))
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any):
        self.prev, self.prev_fastdtype, self.prev_cache_enabled, mode = self._saved.pop()
        if mode is not None:
            _edit_stack().pop()
            mode.__exit__(exc_type, exc_val, exc_tb)
        return super().__exit__(exc_type, exc_val, exc_tb)


def _cast(value, device_type: str, dtype: torch.dtype):
    """torch.amp's ``_cast``: floating tensors (not float64) on ``device_type`` to ``dtype``,
    looking inside mappings (keys too), lists, tuples and other iterables; str/bytes and numpy
    arrays pass through."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if _eligible(value, device_type) else value
    if isinstance(value, (str, bytes)):
        return value
    if _np is not None and isinstance(value, _np.ndarray):
        return value
    if isinstance(value, collections.abc.Mapping):
        return {_cast(k, device_type, dtype): _cast(v, device_type, dtype) for k, v in value.items()}
    if isinstance(value, collections.abc.Iterable):
        iterable = (_cast(v, device_type, dtype) for v in value)
        if isinstance(value, (list, tuple)):
            return type(value)(iterable)
        return iterable
    return value


def _o1_casting() -> bool:
    return _caster.is_enabled()


def _o1_disabled():
    return _caster.disabled()


def _check_device_type(device_type) -> None:
    if not isinstance(device_type, str):
        raise ValueError(f"Expected `device_type` of type `str`, got: `{type(device_type)}`")


def custom_fwd(fwd: Callable | None = None, *, device_type: str,
               cast_inputs: torch.dtype | None = None):
    """``torch.amp.custom_fwd``: decorator for ``forward`` of a ``torch.autograd.Function``.

    ``cast_inputs=None``: ``forward`` runs under the current autocast state (and peak's list
    edits). ``cast_inputs=dtype`` (a torch.dtype, or a string such as ``"fp32"``, ``"bf16"``): inside an autocast-enabled region, floating tensors on
    ``device_type`` (not float64; also inside lists, tuples, dicts and other iterables) are cast
    to ``dtype`` and ``forward`` runs with autocast (and so peak's list edits) off; outside such a
    region it is a no-op. Records the state for ``custom_bwd`` on ``ctx``.
    """
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
            ctx._peak_edits = ([p for d, p in _edit_stack() if d == device_type]
                               if enabled else [])
            return fwd(*args, **kwargs)
        ctx._fwd_used_autocast = False
        ctx._peak_edits = []
        o1 = _o1_casting()  # peak's O1 caster stands down here too (docs/caster.md)
        ctx._peak_o1_off = o1
        if enabled or o1:
            with contextlib.ExitStack() as stack:
                if enabled:
                    stack.enter_context(autocast(device_type=device_type, enabled=False))
                if o1:
                    stack.enter_context(_o1_disabled())
                return fwd(*_cast(args, device_type, cast_inputs),
                           **_cast(kwargs, device_type, cast_inputs))
        return fwd(*args, **kwargs)

    return decorate_fwd


def custom_bwd(bwd: Callable | None = None, *, device_type: str):
    """``torch.amp.custom_bwd``: runs ``backward`` of a ``torch.autograd.Function`` under the
    autocast state its ``custom_fwd``-decorated ``forward`` saw (enabled flag, dtype, and peak's
    list edits)."""
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
            raise AttributeError("custom_bwd: the forward of this Function was not decorated "
                                 "with custom_fwd (peak.amp.custom_fwd or "
                                 "torch.amp.custom_fwd); decorate both forward and backward")
        region = autocast(device_type=device_type, enabled=ctx._fwd_used_autocast,
                          dtype=ctx._dtype)
        edits = getattr(ctx, "_peak_edits", [])
        if edits:
            merged: dict[str, str] = {}
            for policy in edits:  # outer first, inner edits win
                merged.update(policy)
            region._policy = merged
        with region, (_o1_disabled() if getattr(ctx, "_peak_o1_off", False)
                      else contextlib.nullcontext()):
            return bwd(*args, **kwargs)

    return decorate_bwd
