"""The one loss-scaling core of peak: the scale state, the overflow flags, unscale and update.

``peak.amp.GradScaler`` (torch dialect, 0-dim state created lazily), amp's per-loss
``LossScaler`` (Apex dialect) and ``peak.fp16_utils.FP16_Optimizer`` are front doors over it,
each with its own API and checkpoint format. The state (``LossScale``: scale, growth and
hysteresis trackers) lives on one device and changes only there; the overflow flags
(``OverflowFlags``, one per device) are summed on the scale's device by
``peak.ops.update_scale_`` itself. See docs/core.md.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor

from . import ops

__all__ = ["group_by_device_dtype", "OverflowFlags", "sum_flags", "LossScale",
           "unscale_grads_", "core_attribute"]

def group_by_device_dtype(*lists: Sequence[Tensor]) -> list:
    """Split parallel tensor lists into the runs the multi-tensor kernels take: one device and
    one dtype per list. Returns ``[(device, dtype, indices, [list0, list1, ...])]`` with the first
    list's device and dtype, in first-seen order, original order inside a group; rows whose
    other lists differ in dtype (fp16 gradients into fp32 or bf16 masters) form separate groups."""
    groups: dict = {}
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
            if first is not None and first.device == device:
                flag = first
            else:
                flag = torch.zeros(self.shape, dtype=torch.float32, device=device)
            self[device] = flag
        return flag

    def zero_(self) -> None:
        for flag in self.values():
            flag.zero_()

    def any_(self) -> bool:
        """Host read: whether any flag is set (one sync: the flags meet on the first device)."""
        flags = list(self.values())
        flag = flags[0] if len(flags) == 1 else sum_flags(flags, flags[0].device, self.shape)
        return bool(flag.item() != 0)


def sum_flags(flags, device: torch.device, shape: tuple[int, ...] = ()) -> Tensor:
    """Overflow flags (any devices) summed on ``device`` as a new tensor, zero when there are
    none: for a caller that hands one flag on (torch's fused optimizers take one ``found_inf``)
    or reads it on the host. The scale update takes the flags themselves (``update_scale_``)."""
    flags = list(flags)
    if not flags:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    total = flags[0].to(device, non_blocking=True, copy=True)
    for flag in flags[1:]:
        total = total + flag.to(device, non_blocking=True)
    return total


def unscale_grads_(grads: list[Tensor], inv_scale: Tensor | float, found_inf: OverflowFlags, *,
                   outputs: list[Tensor] | None = None, check_only: bool = False,
                   float64: bool = False,
                   on_group: Callable[[list[int], Tensor], None] | None = None) -> None:
    """``outputs[i] = grads[i] * inv_scale`` (in place when ``outputs`` is None), setting the flag
    of each gradient's device when a gradient holds inf/NaN: one kernel pass per (device, dtype).
    ``check_only``: only check (nothing written; ``inv_scale`` must be 1 then). ``on_group``
    (overflow attribution): also gets, per group, the gradients' indices and a per-gradient flag
    vector the same pass writes. Strided slices are handled inside the kernels. ``float64``: take
    float64 gradients in place through torch's kernel, as torch's GradScaler does (else the
    kernels reject them with their usual error)."""
    lists = (grads,) if outputs is None else (grads, outputs)
    per_device_inv: dict = {}
    for device, dtype, indices, columns in group_by_device_dtype(*lists):
        flag = found_inf.for_device(device)
        inv = inv_scale
        if isinstance(inv_scale, Tensor) and inv_scale.device != device:
            inv = per_device_inv.get(device)
            if inv is None:
                inv = per_device_inv[device] = inv_scale.to(device, non_blocking=True, copy=True)
        flags = None
        if on_group is not None:
            flags = torch.zeros(len(indices), dtype=torch.float32, device=device)
        group = columns[0]
        if float64 and dtype == torch.float64 and outputs is None:
            _unscale_with_torch(group, inv, flag, flags)
        elif check_only:
            ops.multi_tensor_check_finite_(group, flag, per_tensor_found_inf=flags)
        else:
            ops.multi_tensor_scale_(group, group if outputs is None else columns[1], inv, flag,
                                    per_tensor_found_inf=flags)
        if on_group is not None:
            on_group(indices, flags)


def _unscale_with_torch(grads: list[Tensor], inv_scale, found_inf: Tensor,
                        flags: Tensor | None) -> None:
    """A dtype the kernels do not take (float64): torch's per-tensor kernel, any strides."""
    if not isinstance(inv_scale, Tensor):
        inv_scale = torch.full((), inv_scale, dtype=torch.float32, device=found_inf.device)
    if flags is None:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return
    for i, g in enumerate(grads):
        torch._amp_foreach_non_finite_check_and_unscale_([g], flags[i], inv_scale)
    torch.maximum(found_inf, flags.max(), out=found_inf)


class LossScale:
    """The dynamic loss-scale state and its update, on one device (no host sync).

    ``update()`` backs S off by ``backoff_factor`` on an overflow (after ``hysteresis``
    overflowing updates in a row, not below ``min_scale``) and grows it by ``growth_factor``
    after ``growth_interval`` clean updates (not above ``max_scale``): ``peak.ops.update_scale_``.
    The tensors (shape ``(1,)`` for the Apex dialect, ``()`` for torch's GradScaler) are created
    by ``materialize(device)``, at once when ``device`` is given; until then the ``init_*`` values
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
        self.init_hysteresis_tracker = hysteresis if hysteresis_tracker is None else hysteresis_tracker
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
        ops.update_scale_(
            self.scale, self.growth_tracker, found_infs, self.growth_factor,
            self.backoff_factor, self.growth_interval, hysteresis=self.hysteresis,
            hysteresis_tracker=self.hysteresis_tracker,
            min_scale=0.0 if self.min_scale is None else self.min_scale,
            max_scale=math.inf if self.max_scale is None else self.max_scale)


def core_attribute(name: str) -> property:
    """A front door's attribute that is its ``LossScale``'s (``self._core``) ``name``, read and
    written through: the front doors keep their own names, the core holds the values."""
    return property(lambda self: getattr(self._core, name),
                    lambda self, value: setattr(self._core, name, value))
