"""The one loss-scaling core of peak: the scale state, the overflow flags, unscale and update.
``peak.amp.GradScaler``, amp's per-loss ``LossScaler`` and ``peak.fp16_utils.FP16_Optimizer`` are
front doors over it. See docs/core.md, "The overflow flag and the loss scale"."""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor

from . import ops

__all__ = ["local_shard", "group_by_device_dtype", "OverflowFlags", "merge_flags", "LossScale",
           "unscale_grads_", "core_attribute", "optimizer_gradients", "reduce_over_meshes",
           "agree_on_overflow", "skip_leaves_state_unset", "check_scale", "SMALLEST_SCALE"]
SMALLEST_SCALE = 2.0 ** -127  # the smallest power of two whose reciprocal float32 holds


def check_scale(what: str, scale: float) -> float:
    """``scale`` if a loss scale can be it: finite, >= SMALLEST_SCALE (below, 1/scale is inf)."""
    if math.isfinite(scale) and scale >= SMALLEST_SCALE:
        return scale
    raise ValueError(f"{what} must be finite and >= 2**-127 (5.9e-39), got {scale!r}")


def local_shard(t):
    """A DTensor's (FSDP2's) local shard (same storage): what the kernels walk; others as is."""
    return t._local_tensor if getattr(t, "device_mesh", None) is not None else t


def group_by_device_dtype(*lists: Sequence[Tensor]) -> list:
    """Split parallel tensor lists into the runs the multi-tensor kernels take (one device and
    dtype per list): ``[(device, dtype, indices, [list0, list1, ...])]``, with the first list's
    device and dtype, groups in first-seen order, rows in their order inside a group."""
    groups: dict = {}
    if any(getattr(t, "device_mesh", None) is not None for t in lists[0][:1]):
        lists = tuple([local_shard(t) for t in column] for column in lists)
    if len(lists) == 1:  # the hot path (GradScaler): a cheaper key
        for i, t in enumerate(lists[0]):
            key = (t.device, t.dtype)
            group = groups.get(key)
            if group is None:
                group = groups[key] = (t.device, t.dtype, [], [[]])
            group[2].append(i)
            group[3][0].append(t)
        return list(groups.values())
    for i, row in enumerate(zip(*lists)):
        key = tuple((t.device, t.dtype) for t in row)
        group = groups.get(key)
        if group is None:
            group = groups[key] = (row[0].device, row[0].dtype, [], [[] for _ in lists])
        group[2].append(i)
        for column, t in zip(group[3], row):
            column.append(t)
    return list(groups.values())


class OverflowFlags(dict):
    """``{device: found_inf}``: one float32 flag of ``shape`` per device, created cleared on first
    use. The kernels set a flag (never clear it); ``zero_()`` clears them all for a new step."""

    def __init__(self, shape: tuple[int, ...] = (1,), *, first: Tensor | None = None) -> None:
        super().__init__()
        self.shape = shape
        self._first = first  # the caller's own flag, used for its device when that comes up

    def for_device(self, device: torch.device) -> Tensor:
        flag = self.get(device)
        if flag is None:
            first = self._first
            flag = self[device] = first if first is not None and first.device == device else (
                torch.zeros(self.shape, dtype=torch.float32, device=device))
        return flag

    def zero_(self) -> None:
        for flag in self.values():
            flag.zero_()

    def any_(self) -> bool:
        """Host read: whether any flag is set (one sync: the flags meet on the first device)."""
        flags = list(self.values())
        flag = flags[0] if len(flags) == 1 else merge_flags(flags, flags[0].device, self.shape)
        return bool(flag.item() != 0)


def merge_flags(flags, device: torch.device, shape: tuple[int, ...] = ()) -> Tensor:
    """Overflow flags (any devices) merged on ``device`` into a new tensor of ``shape``: 1 where
    some flag is set, else 0 (also when there are none), without a host sync -- the one merge,
    ``peak.ops.merge_found_infs`` (NOTE: [Merging overflow flags])."""
    return ops.merge_found_infs(list(flags), device, shape)


def unscale_grads_(grads: list[Tensor], inv_scale: Tensor | float, found_inf: OverflowFlags, *,
                   outputs: list[Tensor] | None = None, check_only: bool = False,
                   float64: bool = False,
                   on_group: Callable[[list[int], Tensor], None] | None = None) -> None:
    """``outputs[i] = grads[i] * inv_scale`` (in place when ``outputs`` is None), setting the flag
    of each gradient's device when a gradient holds inf/NaN: one kernel pass per (device, dtype).
    ``check_only``: only check (``inv_scale`` must be 1). ``on_group`` (overflow attribution):
    also gets, per group, the gradients' indices and the per-gradient flags the same pass writes.
    ``float64``: unscale float64 gradients in place with torch's kernel (as torch's GradScaler)."""
    lists = (grads,) if outputs is None else (grads, outputs)
    per_device_inv: dict = {}
    for device, dtype, indices, columns in group_by_device_dtype(*lists):
        flag = found_inf.for_device(device)
        inv = inv_scale
        if isinstance(inv_scale, Tensor) and inv_scale.device != device:
            inv = per_device_inv.get(device)
            if inv is None:
                inv = per_device_inv[device] = inv_scale.to(device, non_blocking=True, copy=True)
        flags = None if on_group is None else torch.zeros(len(indices), dtype=torch.float32,
                                                          device=device)
        group = columns[0]
        if float64 and dtype == torch.float64 and outputs is None:
            # A dtype the kernels do not take: torch's per-tensor kernel, any strides.
            if not isinstance(inv, Tensor):
                inv = torch.full((), inv, dtype=torch.float32, device=flag.device)
            if flags is None:
                torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv)
            else:
                for i, g in enumerate(group):
                    torch._amp_foreach_non_finite_check_and_unscale_([g], flags[i], inv)
                torch.maximum(flag, flags.max(), out=flag)
        elif check_only:
            ops.multi_tensor_check_finite_(group, flag, per_tensor_found_inf=flags)
        else:
            ops.multi_tensor_scale_(group, group if outputs is None else columns[1], inv, flag,
                                    per_tensor_found_inf=flags)
        if on_group is not None:
            on_group(indices, flags)


class LossScale:
    """The dynamic loss-scale state and its update (``peak.ops.update_scale_``), on one device.
    The tensors (shape ``(1,)`` for the Apex dialect, ``()`` for GradScaler) are created by
    ``materialize(device)``, at once when ``device`` is given; until then the ``init_*`` values
    stand for them. Options are kept as given: each front door checks its own."""

    def __init__(self, init_scale, *, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, hysteresis=1, min_scale=None, max_scale=None,
                 device: torch.device | str | None = None, shape: tuple[int, ...] = (1,),
                 growth_tracker: int = 0, hysteresis_tracker: int | None = None) -> None:
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.shape = shape
        self.init_scale = init_scale
        self.init_growth_tracker = growth_tracker
        self.init_hysteresis_tracker = (hysteresis if hysteresis_tracker is None
                                        else hysteresis_tracker)
        self.scale: Tensor | None = None
        self.growth_tracker: Tensor | None = None
        self.hysteresis_tracker: Tensor | None = None
        self.found_inf = OverflowFlags(shape)
        if device is not None:
            self.materialize(torch.device(device))
            self.found_inf.for_device(self.scale.device)  # the scale's own device comes first

    def materialize(self, device: torch.device) -> None:
        """Create the state tensors on ``device`` from the ``init_*`` values."""
        self.scale = torch.full(self.shape, self.init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.full(self.shape, self.init_growth_tracker, dtype=torch.int32,
                                         device=device)
        self.hysteresis_tracker = torch.full(self.shape, self.init_hysteresis_tracker,
                                             dtype=torch.int32, device=device)

    def dematerialized(self) -> "LossScale":
        """A copy whose ``init_*`` values hold the current state and which has no tensors (host
        reads): what a pickle keeps, re-created lazily, as torch's GradScaler does."""
        copy = object.__new__(LossScale)
        copy.__dict__.update(self.__dict__)
        if self.scale is not None:
            copy.init_scale = float(self.scale.item())
            copy.init_growth_tracker = int(self.growth_tracker.item())
            copy.init_hysteresis_tracker = int(self.hysteresis_tracker.item())
        copy.scale = copy.growth_tracker = copy.hysteresis_tracker = None
        copy.found_inf = OverflowFlags(self.shape)
        return copy

    def inv_scale(self) -> Tensor:
        """1/S on the scale's device; the reciprocal in float64, as torch (float32 division can be
        imprecise under some compile options), except on MPS, which has no float64."""
        if self.scale.device.type == "mps":
            return self.scale.reciprocal()
        return self.scale.double().reciprocal().float()

    def unscale_(self, grads: list[Tensor], **kwargs) -> None:
        """``unscale_grads_`` by 1/S into this state's overflow flags."""
        unscale_grads_(grads, self.inv_scale(), self.found_inf, **kwargs)

    def update(self, found_infs: Sequence[Tensor] | None = None) -> None:
        """The scale update from ``found_infs`` (default: this state's own flags)."""
        if found_infs is None:
            found_infs = list(self.found_inf.values())
        ops.update_scale_(self.scale, self.growth_tracker, found_infs, self.growth_factor,
                          self.backoff_factor, min(self.growth_interval, 2**31 - 1),  # (int32)
                          hysteresis=self.hysteresis, hysteresis_tracker=self.hysteresis_tracker,
                          min_scale=0.0 if self.min_scale is None else self.min_scale,
                          max_scale=math.inf if self.max_scale is None else self.max_scale)


def core_attribute(name: str, owner: str = "_core") -> property:
    """A front door's attribute that reads and writes ``self.<owner>``'s ``name`` (by default its
    ``LossScale``'s): the front door keeps its own names, the object behind it the values."""
    return property(lambda self: getattr(getattr(self, owner), name),
                    lambda self, value: setattr(getattr(self, owner), name, value))


def reduce_over_meshes(parts, tensors, maximum: bool = False):
    """``parts`` (a tensor, or tensors one after another) all-reduced in place (SUM, or MAX with
    ``maximum``) over every dimension of the device meshes of ``tensors`` (DTensors; other tensors
    and None have none): one reduce per distinct mesh, by value, as DTensor caches its sharding
    specs, so equal meshes built apart can reach one optimizer as different objects. Nothing to do
    (nor to import) without a mesh. Returns ``parts``."""
    meshes = []
    for m in (getattr(t, "device_mesh", None) for t in tensors):
        if m is not None and not any(m == k for k in meshes):
            meshes.append(m)
    if not meshes:
        return parts
    import torch.distributed as dist  # noqa: PLC0415 (only for sharded tensors)

    op = dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM
    for part in [parts] if isinstance(parts, Tensor) else parts:
        for mesh in meshes:
            for dim in range(mesh.ndim):
                dist.all_reduce(part, op=op, group=mesh.get_group(dim))
    return parts


def agree_on_overflow(optimizer, per_device_found_inf: dict) -> None:
    """Sharded gradients: an inf/NaN in one rank's shard must skip the step on every rank, so the
    overflow flags are all-reduced (MAX) over every dimension of the gradients' meshes (what
    torch's ShardedGradScaler does for FSDP1). Ordinary gradients (DDP all-reduced them already,
    or one process) cost nothing here."""
    flags = [per_device_found_inf[d] for d in sorted(per_device_found_inf, key=str)]
    reduce_over_meshes(flags, (p.grad for g in optimizer.param_groups for p in g["params"]), True)


def optimizer_gradients(optimizer, with_owners: bool) -> tuple[list, list]:
    """The optimizer's gradients as the kernels take them and, with ``with_owners``, their
    ``(param, group index, param index)``. A DTensor gradient is its local shard; a sparse one its
    values -- of a copy, coalesced first for fp16, whose duplicate indices may overflow only once
    summed (as torch), replacing ``.grad``."""
    grads, owners = [], []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, param in enumerate(group["params"]):
            grad = param.grad
            if grad is None:
                continue
            grad = local_shard(grad)
            if grad.is_sparse:  # (a copy: two embeddings' sparse gradients may share values)
                param.grad = grad = (grad.coalesce() if grad.dtype == torch.float16
                                     else grad).clone()
                grad = grad._values()
            grads.append(grad)
            if with_owners:
                owners.append((param, gi, pi))
    return grads, owners


def skip_leaves_state_unset(optimizer) -> list:
    """torch's fused SGD before its momentum buffers exist: its first step makes them (for each
    parameter with a gradient) with empty_like, which a skip on the device leaves uninitialised
    (torch's GradScaler then trains on garbage): the parameters whose buffers it would make."""
    state = optimizer.state
    return [p for g in optimizer.param_groups if g.get("momentum") for p in g["params"]
            if p.grad is not None and state.get(p, {}).get("momentum_buffer") is None
            ] if isinstance(optimizer, torch.optim.SGD) else []
