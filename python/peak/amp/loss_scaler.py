"""Apex's per-loss scaler (``amp.scale_loss``, one ``LossScaler`` per ``loss_id``): dynamic or
static loss scaling, a front door over peak's one scaling core (``peak.scaling``), under Apex's
names and checkpoint format. Its state is the core's device tensors, changed only on the device;
the Apex API reads the overflow flag once per ``scale_loss`` exit (``update_scale``), as Apex
did. docs/amp_api.md, "Loss scaler", has the state and the algorithm.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Sequence

import torch

from peak import ops
from peak.scaling import LossScale, core_attribute, group_by_device_dtype, unscale_grads_


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
        # Apex treats min_loss_scale None and 0 alike ("no floor").
        self.min_loss_scale = float(min_loss_scale) if min_loss_scale else 0.0
        self.max_loss_scale = float(max_loss_scale) if max_loss_scale is not None else math.inf
        if self.dynamic:
            initial = min(self.max_loss_scale, float(init_scale))
            self._static_value = None
        else:
            initial = float(loss_scale)
            self._static_value = initial
        self._core = LossScale(initial, growth_factor=float(scale_factor),
                               backoff_factor=float(backoff_factor),
                               growth_interval=int(scale_window), hysteresis=int(hysteresis),
                               min_scale=self.min_loss_scale, max_scale=self.max_loss_scale,
                               device=self.device)
        # The core's tensors under Apex's names (the same objects: they change only in place).
        self.scale = self._core.scale
        self.growth_tracker = self._core.growth_tracker
        self.hysteresis_tracker = self._core.hysteresis_tracker
        self.found_inf = self._core.found_inf.for_device(self.device)

    growth_factor = core_attribute("growth_factor")
    backoff_factor = core_attribute("backoff_factor")
    growth_interval = core_attribute("growth_interval")
    hysteresis = core_attribute("hysteresis")

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
        return self._core.found_inf.for_device(device)

    def clear_overflow_state(self) -> None:
        self._core.found_inf.zero_()

    def has_overflow(self) -> bool:
        """Host read of the overflow flags (a sync)."""
        return self._core.found_inf.any_()

    # ------------------------------------------------------------------ unscaling
    def _inv_scale(self, scale_override=None):
        if scale_override is not None:
            return 1.0 / float(scale_override)
        if self._static_value is not None:
            return 1.0 / self._static_value
        return self._core.inv_scale()

    def unscale(self, model_grads: Sequence[torch.Tensor], master_grads: Sequence[torch.Tensor],
                scale_override=None) -> None:
        """``master_grads[i] = model_grads[i] / S``, flagging inf/NaN.  Pass the same list twice to
        unscale in place."""
        outputs = None if model_grads is master_grads else list(master_grads)
        unscale_grads_(list(model_grads), self._inv_scale(scale_override), self._core.found_inf,
                       outputs=outputs)

    def unscale_with_stashed(self, model_grads: Sequence[torch.Tensor], stashed_grads: Sequence[torch.Tensor],
                             out_grads: Sequence[torch.Tensor]) -> None:
        """``out[i] = model_grads[i] / S + stashed_grads[i]``; only the new ``model_grads`` are checked
        for inf/NaN (the stash was checked when it was unscaled)."""
        inv_scale = self._inv_scale()
        for device, _, _, (xs, ys, outs) in group_by_device_dtype(model_grads, stashed_grads,
                                                                  out_grads):
            inv = inv_scale.to(device) if isinstance(inv_scale, torch.Tensor) else inv_scale
            ops.multi_tensor_axpby_(xs, ys, outs, inv, 1.0, self.found_inf_for(device), check="x")

    # ------------------------------------------------------------------ updating
    def update(self) -> None:
        """Update the scale on the device from the overflow flags (no host sync)."""
        if not self.dynamic:
            # A static scaler never looks at overflows; it only counts updates (Apex's _unskipped).
            self.growth_tracker.add_(1)
            return
        self._core.update()

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
