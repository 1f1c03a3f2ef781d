"""What GradScaler takes in, checked and gathered: its constructor options (with torch's errors
and peak's), an optimizer's gradients as the kernels take them (DTensor shards, sparse values),
and the agreement of sharded ranks on an overflow."""
from __future__ import annotations

import math
import numbers

import torch

ON_MIN_SCALE = ("warn", "raise", "keep")


class _ConfigError(ValueError, AssertionError):
    """A bad constructor argument. torch raises AssertionError for some of these (growth/backoff
    factors), so the error is both a ValueError and an AssertionError."""


def _check_float(name: str, value, *, allow_none: bool = False) -> float | None:
    """A real number (Python, numpy or a one-element tensor, as torch takes) as a float."""
    if value is None and allow_none:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"GradScaler: {name} must be a float, got {type(value).__name__} ({value!r})")
    return float(value)


def _check_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"GradScaler: {name} must be an int, got {type(value).__name__} ({value!r})")
    return int(value)


def check_options(init_scale, growth_factor, backoff_factor, growth_interval, hysteresis,
                  min_scale, max_scale, on_min_scale) -> tuple:
    """GradScaler's options as numbers, or the error torch (or peak, for its own) raises."""
    init_scale = _check_float("init_scale", init_scale)
    growth_factor = _check_float("growth_factor", growth_factor)
    backoff_factor = _check_float("backoff_factor", backoff_factor)
    min_scale = _check_float("min_scale", min_scale, allow_none=True)
    max_scale = _check_float("max_scale", max_scale, allow_none=True)
    growth_interval = _check_int("growth_interval", growth_interval)
    hysteresis = _check_int("hysteresis", hysteresis)
    if on_min_scale not in ON_MIN_SCALE:
        raise ValueError(f"GradScaler: on_min_scale must be one of {ON_MIN_SCALE}, "
                         f"got {on_min_scale!r}")
    # torch's two checks (AssertionError there; _ConfigError is also an AssertionError).
    if growth_factor <= 1.0:
        raise _ConfigError("The growth factor must be > 1.0.")
    if backoff_factor >= 1.0:
        raise _ConfigError("The backoff factor must be < 1.0.")
    if not (math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"GradScaler: init_scale must be finite and > 0, got {init_scale}")
    if not backoff_factor > 0:
        raise ValueError(f"GradScaler: backoff_factor must be > 0, got {backoff_factor}")
    if growth_interval < 1:
        raise ValueError(f"GradScaler: growth_interval must be >= 1, got {growth_interval}")
    if hysteresis < 1:
        raise ValueError(f"GradScaler: hysteresis must be >= 1 (1 backs off at the first "
                         f"overflow, as torch), got {hysteresis}")
    if min_scale is not None and not (0 <= min_scale <= init_scale):
        raise ValueError(f"GradScaler: min_scale={min_scale} must be in [0, init_scale="
                         f"{init_scale}]; lower min_scale or raise init_scale")
    if max_scale is not None and not (max_scale >= init_scale):
        raise ValueError(f"GradScaler: max_scale={max_scale} must be >= init_scale="
                         f"{init_scale}; raise max_scale or lower init_scale")
    return (init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale,
            max_scale)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient (FSDP2's ``fully_shard``) is unscaled through its local shard, which
    shares its storage; anything else is itself."""
    local = getattr(grad, "_local_tensor", None)
    return local if local is not None and hasattr(grad, "device_mesh") else grad


def _sharded_meshes(optimizer) -> list:
    """The device meshes of the optimizer's DTensor gradients (none for ordinary tensors)."""
    meshes = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            mesh = getattr(p.grad, "device_mesh", None) if p.grad is not None else None
            if mesh is not None and all(m is not mesh for m in meshes):
                meshes.append(mesh)
    return meshes


def agree_on_overflow(optimizer, per_device_found_inf: dict) -> None:
    """Sharded gradients: an inf/NaN in one rank's shard must skip the step on every rank, so the
    overflow flags are all-reduced (MAX) over every dimension of the gradients' meshes (what
    torch's ShardedGradScaler does for FSDP1). Ordinary gradients (DDP all-reduced them already,
    or one process) cost nothing here."""
    meshes = _sharded_meshes(optimizer)
    if not meshes:
        return
    import torch.distributed as dist  # noqa: PLC0415 (only for sharded gradients)

    for device in sorted(per_device_found_inf, key=str):
        flag = per_device_found_inf[device]
        for mesh in meshes:
            for dim in range(mesh.ndim):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))


def optimizer_gradients(optimizer, with_owners: bool) -> tuple[list, list]:
    """The optimizer's gradients as the kernels take them and, with ``with_owners``, their
    ``(param, group index, param index)``. A DTensor gradient is its local shard; a sparse one its
    values -- coalesced first for fp16/bf16, whose duplicate indices may overflow only once summed
    (torch does this for fp16), replacing ``.grad``."""
    grads, owners = [], []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, param in enumerate(group["params"]):
            grad = param.grad
            if grad is None:
                continue
            grad = _local(grad)
            if grad.is_sparse:
                if grad.dtype in (torch.float16, torch.bfloat16):
                    param.grad = grad = grad.coalesce()
                grad = grad._values()
            grads.append(grad)
            if with_owners:
                owners.append((param, gi, pi))
    return grads, owners
