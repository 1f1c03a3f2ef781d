"""The one loss scaler of peak: dynamic or static loss scaling with its state on the device.

Both front doors use it: ``amp.scale_loss`` (Apex dialect, one ``LossScaler`` per ``loss_id``) and,
later, ``peak.amp.GradScaler`` (torch dialect).  Its state is four device tensors:

====================  ============  ==================================================================
``scale``             float32 [1]   the current loss scale S
``growth_tracker``    int32 [1]     clean (overflow-free) updates since the last change of S; this is
                                    Apex's ``_unskipped`` and torch's ``_growth_tracker``
``hysteresis_tracker`` int32 [1]    overflows still tolerated before backing off (hysteresis=1: none)
``found_inf``         float32 [1]   set to 1.0 by the multi-tensor kernels when a gradient is inf/NaN
====================  ============  ==================================================================

They change only on the device: through the multi-tensor kernels (``found_inf``) and
``peak.ops.update_scale_`` (a static scaler only counts its updates), so nothing here forces a
device→host sync.  The Apex API needs exactly one sync per
``scale_loss`` exit, to decide whether to skip the next ``optimizer.step()`` (``update_scale``), as Apex
itself did; ``update()`` is the sync-free variant for callers that skip on the device.

Dynamic algorithm (Apex's, with its knobs exposed): start at ``min(init_scale, max_loss_scale)``; on an
overflow multiply by ``backoff_factor`` (0.5), not going below ``min_loss_scale``; after
``scale_window`` (2000) clean updates multiply by ``scale_factor`` (2.0), not going above
``max_loss_scale``.  A static scaler never checks for overflow and never changes its scale; it only
counts updates in ``growth_tracker`` (Apex's ``_unskipped`` does the same).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Sequence

import torch

from peak import ops

def group_by_device_dtype(*lists: Sequence[torch.Tensor]):
    """Split parallel tensor lists into runs that share (device, dtype) per list, as the multi-tensor
    kernels require.  Yields ``(device, [list0, list1, ...])`` keeping the original order inside a group."""
    groups: dict = {}
    for row in zip(*lists):
        key = tuple((t.device, t.dtype) for t in row)
        groups.setdefault(key, []).append(row)
    for key, rows in groups.items():
        yield key[0][0], [list(col) for col in zip(*rows)]


class LossScaler:
    def __init__(
        self,
        loss_scale="dynamic",
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = 2.0**24,
        *,
        backoff_factor: float = 0.5,
        hysteresis: int = 1,
        device: torch.device | str | None = None,
    ) -> None:
        self.dynamic = loss_scale == "dynamic"
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.growth_factor = float(scale_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(scale_window)
        self.hysteresis = int(hysteresis)
        # Apex treats min_loss_scale None and 0 alike ("no floor").
        self.min_loss_scale = float(min_loss_scale) if min_loss_scale else 0.0
        self.max_loss_scale = float(max_loss_scale) if max_loss_scale is not None else math.inf
        if self.dynamic:
            initial = min(self.max_loss_scale, float(init_scale))
            self._static_value = None
        else:
            initial = float(loss_scale)
            self._static_value = initial
        dev = self.device
        self.scale = torch.full((1,), initial, dtype=torch.float32, device=dev)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32, device=dev)
        self.hysteresis_tracker = torch.full((1,), self.hysteresis, dtype=torch.int32, device=dev)
        self.found_inf = torch.zeros(1, dtype=torch.float32, device=dev)
        self._other_found_inf: dict[torch.device, torch.Tensor] = {}

    # ------------------------------------------------------------------ reading the scale
    def loss_scale(self) -> float:
        """The current scale as a Python float (a host sync for a dynamic scaler)."""
        if self._static_value is not None:
            return self._static_value
        return float(self.scale.item())

    def is_static_one(self) -> bool:
        """True for a static scale of exactly 1.0 (known on the host, no sync)."""
        return self._static_value == 1.0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss.float() * S`` without reading S on the host."""
        if self._static_value is not None:
            return loss.float() * self._static_value
        return loss.float() * self.scale.to(loss.device, non_blocking=True).reshape(())

    # Apex-compatible attributes (its tests set ``loss_scalers[i]._loss_scale = 4.0`` directly).
    @property
    def _loss_scale(self) -> float:
        return self.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        self.scale.fill_(float(value))
        if not self.dynamic:
            self._static_value = float(value)

    @property
    def _unskipped(self) -> int:
        return int(self.growth_tracker.item())

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        self.growth_tracker.fill_(int(value))

    # ------------------------------------------------------------------ overflow flag
    def found_inf_for(self, device: torch.device) -> torch.Tensor:
        """The overflow flag the kernels write for tensors on ``device``."""
        if device == self.device:
            return self.found_inf
        flag = self._other_found_inf.get(device)
        if flag is None:
            flag = self._other_found_inf[device] = torch.zeros(1, dtype=torch.float32, device=device)
        return flag

    def clear_overflow_state(self) -> None:
        self.found_inf.zero_()
        for flag in self._other_found_inf.values():
            flag.zero_()

    def _fold_found_inf(self) -> torch.Tensor:
        for flag in self._other_found_inf.values():
            torch.maximum(self.found_inf, flag.to(self.device), out=self.found_inf)
        return self.found_inf

    def has_overflow(self) -> bool:
        """Host read of the overflow flag (a sync)."""
        return bool(self._fold_found_inf().item() != 0)

    # ------------------------------------------------------------------ unscaling
    def _inv_scale(self, device: torch.device, scale_override=None):
        if scale_override is not None:
            return 1.0 / float(scale_override)
        if self._static_value is not None:
            return 1.0 / self._static_value
        return torch.reciprocal(self.scale).to(device, non_blocking=True)

    def unscale(self, model_grads: Sequence[torch.Tensor], master_grads: Sequence[torch.Tensor],
                scale_override=None) -> None:
        """``master_grads[i] = model_grads[i] / S``, flagging inf/NaN.  Pass the same list twice to
        unscale in place."""
        in_place = model_grads is master_grads
        lists = (model_grads,) if in_place else (model_grads, master_grads)
        for device, grouped in group_by_device_dtype(*lists):
            xs = grouped[0]
            outs = xs if in_place else grouped[1]
            ops.multi_tensor_scale_(xs, outs, self._inv_scale(device, scale_override), self.found_inf_for(device))

    def unscale_with_stashed(self, model_grads: Sequence[torch.Tensor], stashed_grads: Sequence[torch.Tensor],
                             out_grads: Sequence[torch.Tensor]) -> None:
        """``out[i] = model_grads[i] / S + stashed_grads[i]``; only the new ``model_grads`` are checked
        for inf/NaN (the stash was checked when it was unscaled)."""
        for device, (xs, ys, outs) in group_by_device_dtype(model_grads, stashed_grads, out_grads):
            ops.multi_tensor_axpby_(xs, ys, outs, self._inv_scale(device), 1.0,
                                    self.found_inf_for(device), check="x")

    # ------------------------------------------------------------------ updating
    def update(self) -> None:
        """Update the scale on the device from the overflow flag (no host sync)."""
        if not self.dynamic:
            # A static scaler never looks at overflows; it only counts updates (Apex's _unskipped).
            self.growth_tracker.add_(1)
            return
        ops.update_scale_(
            self.scale, self.growth_tracker, self._fold_found_inf(),
            self.growth_factor, self.backoff_factor, self.growth_interval,
            hysteresis=self.hysteresis, hysteresis_tracker=self.hysteresis_tracker,
            min_scale=self.min_loss_scale, max_scale=self.max_loss_scale,
        )

    def update_scale(self) -> bool:
        """Apex's ``update_scale``: update S and return whether the step must be skipped.  For a dynamic
        scaler this reads the overflow flag on the host once (the one sync of ``scale_loss``)."""
        should_skip = self.dynamic and self.has_overflow()
        self.update()
        return should_skip

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        """Apex format: ``{"loss_scale": float, "unskipped": int}``."""
        return OrderedDict(loss_scale=self.loss_scale(), unskipped=self._unskipped)

    def load_state_dict(self, state: dict) -> None:
        self._loss_scale = state["loss_scale"]
        self._unskipped = state["unskipped"]
        self.hysteresis_tracker.fill_(self.hysteresis)
        self.clear_overflow_state()

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self.loss_scale()}, unskipped={self._unskipped}, device={self.device})"
