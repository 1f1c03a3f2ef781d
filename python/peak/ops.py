"""Typed wrappers over ``torch.ops.peak.*`` (the C++ multi-tensor kernels), and their fake kernels.

Every op works on lists of float32 / float16 / bfloat16 tensors on one device (group tensors by
device and dtype first), does its math in float32, and is one pass over memory. The overflow flag
``found_inf`` is a float32 tensor of one element on the tensors' device, set to 1.0 by an op that
sees inf/NaN and never cleared by one: zero it yourself (``found_inf.zero_()``) when a new step
begins. Scales may be device tensors so that nothing waits for the host. Writes bump no autograd
version counter (as Apex's amp_C and torch's fused optimizer kernels): autograd cannot see that
a tensor it saved was written, so write none that a backward still to come needs."""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["DEFAULT_CHUNK_SIZE", "new_found_inf", "multi_tensor_scale_", "multi_tensor_axpby_",
           "multi_tensor_l2norm", "update_scale_", "merge_found_infs", "multi_tensor_check_finite_",
           "fused_adam_", "fused_sgd_", "fused_lamb_", "fused_adagrad_", "fused_novograd_",
           "cpu_level", "cpu_levels"]

#: Elements per chunk (one CUDA block, one CPU task); see NOTE: [Chunking] in csrc/core.
DEFAULT_CHUNK_SIZE = 65536

_CHECKS = {"none": 0, "x": 1, "y": 2, "both": 3}


# The overloads, resolved once: calling ``.default`` skips the packet's per-call overload lookup,
# so a wrapper costs a few type checks over the raw op (measured in benchmarks/README.md).
_scale_op = torch.ops.peak.multi_tensor_scale_.default
_axpby_op = torch.ops.peak.multi_tensor_axpby_.default
_l2norm_op = torch.ops.peak.multi_tensor_l2norm.default
_check_finite_op = torch.ops.peak.multi_tensor_check_finite_.default
_update_scale_op = torch.ops.peak.update_scale_.default
_merge_op = torch.ops.peak.merge_found_infs.default


def _list(name: str, tensors) -> list[Tensor]:
    if type(tensors) is list:  # the common case, passed as it is (no copy)
        return tensors
    if isinstance(tensors, Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    return list(tensors)


def device_scalar(value: float | Tensor, device: torch.device | str) -> Tensor:
    """A number or one-element tensor as float32 ``[1]`` on ``device`` (a float32 tensor already
    there is viewed, not copied: a captured lr stays live)."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.float32).reshape(1)
    return torch.full((1,), float(value), dtype=torch.float32, device=device)


def _scalar_tensor(name: str, value, like: Tensor) -> Tensor:
    # (a tensor goes to the op as it is, whose checks name a wrong dtype, shape or device)
    if isinstance(value, Tensor):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float or a float32 tensor of one element, "
                        f"got {type(value).__name__}")
    return device_scalar(value, like.device)


def new_found_inf(device: torch.device | str = "cpu") -> Tensor:
    """A cleared overflow flag for ``device``."""
    return torch.zeros(1, dtype=torch.float32, device=device)


def cpu_level() -> str:
    """The level of the CPU kernels in use: ``"baseline"``, ``"avx2"`` or ``"avx512"`` (the best
    this CPU runs, unless ``PEAK_CPU_LEVEL`` forced one), or the single level of a build made
    with ``PEAK_CPU_ISA=native|avx2|baseline``. See docs/build.md, "CPU levels"."""
    from . import _C
    return _C.cpu_levels()["active"]


def cpu_levels() -> dict:
    """The CPU kernels' levels: ``active`` (in use), ``compiled`` (in this build, lowest first),
    ``supported`` (of those, the ones this CPU runs) and ``forced`` (``PEAK_CPU_LEVEL``'s value
    when it chose the level, else None)."""
    from . import _C
    return dict(_C.cpu_levels())


def multi_tensor_scale_(inputs: Sequence[Tensor], outputs: Sequence[Tensor], scale: float | Tensor,
                        found_inf: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
                        per_tensor_found_inf: Tensor | None = None) -> None:
    """``outputs[i] = inputs[i] * scale``; sets ``found_inf`` if any input holds inf/NaN.

    ``outputs`` may be ``inputs`` (in place; passing the very same list object sends it to C++
    once, which is cheaper for long lists). Input and output dtypes may differ (e.g. fp16 grads
    into fp32 master grads); the product is computed in fp32 and rounded once.
    ``per_tensor_found_inf`` (optional, float32, one element per input, on the device): the same
    pass sets element ``i`` to 1.0 when ``inputs[i]`` holds inf/NaN (never clears it)."""
    in_place = outputs is inputs
    inputs = _list("inputs", inputs)
    outputs = None if in_place else _list("outputs", outputs)
    scale_t = _scalar_tensor("scale", scale, found_inf)
    if chunk_size == DEFAULT_CHUNK_SIZE and per_tensor_found_inf is None:
        # The hot call (every unscale): defaults left out, the dispatcher parses fewer keywords.
        _scale_op(inputs, outputs, scale=scale_t, found_inf=found_inf)
        return
    _scale_op(inputs, outputs, scale=scale_t, found_inf=found_inf, chunk_size=chunk_size,
              per_tensor_found_inf=per_tensor_found_inf)


def multi_tensor_axpby_(xs: Sequence[Tensor], ys: Sequence[Tensor], outputs: Sequence[Tensor],
                        a: float | Tensor, b: float | Tensor, found_inf: Tensor, *,
                        check: str = "both", chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
    """``outputs[i] = a * xs[i] + b * ys[i]``; ``check`` ("both", "x", "y", "none") picks which
    inputs set ``found_inf`` when they hold inf/NaN. ``outputs`` may be ``xs`` or ``ys``.
    ``a`` and ``b`` may be float32 tensors of one element on the device (no host sync)."""
    if check not in _CHECKS:
        raise ValueError(f"check must be one of {sorted(_CHECKS)}, got {check!r}")
    a_t = _scalar_tensor("a", a, found_inf)
    b_t = _scalar_tensor("b", b, found_inf)
    _axpby_op(_list("xs", xs), _list("ys", ys), _list("outputs", outputs), a=a_t, b=b_t,
              found_inf=found_inf, check=_CHECKS[check], chunk_size=chunk_size)


def multi_tensor_l2norm(tensors: Sequence[Tensor], *, per_tensor: bool = False,
                        chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[Tensor, Tensor]:
    """The L2 norm of all elements of ``tensors`` (float32, shape ``[1]``) and, with
    ``per_tensor=True``, each tensor's norm (float32, ``[len(tensors)]``; else empty).
    Accumulated in fp32. An empty list has norm 0 (returned on the CPU)."""
    tensors = _list("tensors", tensors)
    if not tensors:
        return torch.zeros(1), torch.zeros(0)
    return _l2norm_op(tensors, per_tensor=per_tensor, chunk_size=chunk_size)


def update_scale_(scale: Tensor, growth_tracker: Tensor, found_inf: Tensor | Sequence[Tensor],
                  growth_factor: float, backoff_factor: float, growth_interval: int, *,
                  hysteresis: int = 1, hysteresis_tracker: Tensor | None = None,
                  min_scale: float = 0.0, max_scale: float = math.inf) -> None:
    """The dynamic loss-scale update, in place and on the state's device (no host sync).

    ``found_inf``: the step's overflow flag, or a list of them (one per device and optimizer,
    on any devices): the op merges them on the scale's device, so callers never merge flags.
    On overflow (any flag ``!= 0``) the hysteresis tracker counts down; when it reaches 0 the
    scale becomes ``max(scale * backoff_factor, min_scale)``, never below 2^-126 (a zero scale
    would make NaN weights: NOTE: [The scale never reaches zero]); the growth tracker resets.
    Otherwise the growth tracker counts up and the hysteresis tracker refills; after
    ``growth_interval`` clean updates in a row the scale becomes ``min(scale * growth_factor,
    max_scale)`` (kept only if finite). With the defaults this is ``torch._amp_update_scale_``
    (which goes below 2^-126, to 0). ``scale``, ``found_inf``: float32, one element; trackers:
    int32, one element."""
    found_infs = [found_inf] if isinstance(found_inf, Tensor) else _list("found_inf", found_inf)
    _update_scale_op(scale, growth_tracker, hysteresis_tracker, found_infs,
                     growth_factor=float(growth_factor), backoff_factor=float(backoff_factor),
                     growth_interval=int(growth_interval), hysteresis=int(hysteresis),
                     min_scale=float(min_scale), max_scale=float(max_scale))


# ---- fake kernels (shape/dtype propagation for torch.compile and FakeTensor) -------------------
# An op that only writes its inputs returns nothing and makes no tensor, so one fake that takes
# any arguments serves them all (their schemas live in csrc/ops/schemas.h). The fakes of the ops
# that return tensors take the schema's defaults: torch leaves out arguments equal to their
# default when it calls a Python fake kernel.

def _writes_inputs_only(*args, **kwargs):
    # A meta tensor among real ones sends the call here, where nothing would be written.
    devices = {t.device.type for t in torch.utils._pytree.tree_leaves((args, kwargs))
               if isinstance(t, Tensor)}
    if "meta" in devices and len(devices) > 1:
        raise RuntimeError(f"peak: a meta tensor was passed with tensors on {devices - {'meta'}}; "
                           "nothing would be computed: put every tensor argument on one device")


for _op in ("multi_tensor_scale_", "multi_tensor_axpby_", "multi_tensor_check_finite_",
            "update_scale_", "fused_adam_", "fused_sgd_", "fused_lamb_", "fused_adagrad_",
            "fused_novograd_"):
    torch.library.register_fake(f"peak::{_op}", _writes_inputs_only)
del _op


@torch.library.register_fake("peak::multi_tensor_l2norm")
def _(tensors, *, per_tensor=False, chunk_size=DEFAULT_CHUNK_SIZE):
    first = tensors[0]
    total = first.new_empty((1,), dtype=torch.float32)
    per = first.new_empty((len(tensors) if per_tensor else 0,), dtype=torch.float32)
    return total, per


def merge_found_infs(found_infs: Sequence[Tensor], device: torch.device | str,
                     shape: Sequence[int] = ()) -> Tensor:
    """Overflow flags of any devices merged into a new float32 tensor of ``shape`` on
    ``device``: 1.0 where some flag is set, else 0.0 (NOTE: [Merging overflow flags]). One
    kernel for every backend, written with ATen ops."""
    return _merge_op(_list("found_infs", found_infs), device=torch.device(device),
                     shape=list(shape))


@torch.library.register_fake("peak::merge_found_infs")
def _(found_infs, *, device, shape):
    return torch.empty(shape, dtype=torch.float32, device=device)


def multi_tensor_check_finite_(tensors: Sequence[Tensor], found_inf: Tensor, *,
                               chunk_size: int = DEFAULT_CHUNK_SIZE,
                               per_tensor_found_inf: Tensor | None = None) -> None:
    """Reads ``tensors`` once and sets ``found_inf`` (and ``per_tensor_found_inf[i]``) when they
    hold inf/NaN; writes nothing else. The check before a fused optimizer step, which unscales
    in its own pass."""
    _check_finite_op(_list("tensors", tensors), found_inf=found_inf, chunk_size=chunk_size,
                     per_tensor_found_inf=per_tensor_found_inf)


# ---- fused optimizer steps ---------------------------------------------------------------------
# The tensor lists positionally, in the op's order, then every scalar and flag by name (NOTE:
# [Keyword-only scalars] in csrc/ops/schemas.h, which also says what each means); the optimizers
# in peak.optimizers build them. A plain forward to the resolved overload: these run once per
# bucket of parameters, and their arguments are checked in C++.

def fused_adam_(params, grads, master_params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                **scalars) -> None:
    """Adam / AdamW (``adam_w_mode``) over lists of parameters, one pass: ``peak::fused_adam_``."""
    _fused_adam_op(params, grads, master_params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                   **scalars)


def fused_sgd_(params, grads, master_params, momentum_buffers, steps, **scalars) -> None:
    """SGD with momentum / Nesterov over lists of parameters, one pass: ``peak::fused_sgd_``."""
    _fused_sgd_op(params, grads, master_params, momentum_buffers, steps, **scalars)


def fused_lamb_(params, grads, master_params, exp_avgs, exp_avg_sqs, steps, **scalars) -> None:
    """LAMB over lists of parameters (two passes: moments, then trust ratios):
    ``peak::fused_lamb_``. On shards, ``updates=`` runs the first pass alone and ``updates=,
    weight_norms=, update_norms=`` the second (NOTE: [LAMB in two calls])."""
    _fused_lamb_op(params, grads, master_params, exp_avgs, exp_avg_sqs, steps, **scalars)


def fused_adagrad_(params, grads, master_params, state_sums, steps, **scalars) -> None:
    """Adagrad over lists of parameters, one pass: ``peak::fused_adagrad_``."""
    _fused_adagrad_op(params, grads, master_params, state_sums, steps, **scalars)


def fused_novograd_(params, grads, master_params, exp_avgs, exp_avg_sqs, steps,
                    **scalars) -> None:
    """NovoGrad over lists of parameters: ``peak::fused_novograd_``."""
    _fused_novograd_op(params, grads, master_params, exp_avgs, exp_avg_sqs, steps, **scalars)


_fused_adam_op = torch.ops.peak.fused_adam_.default
_fused_sgd_op = torch.ops.peak.fused_sgd_.default
_fused_lamb_op = torch.ops.peak.fused_lamb_.default
_fused_adagrad_op = torch.ops.peak.fused_adagrad_.default
_fused_novograd_op = torch.ops.peak.fused_novograd_.default
