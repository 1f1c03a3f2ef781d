"""Lightning ``Precision`` plugins (tested with lightning 2.6.6) for both of peak's dialects:
:class:`AmpPrecision` (Apex) and :class:`MixedPrecision` (torch); docs/integrations.md, "Lightning".
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision as _LightningMixedPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from .. import _dtypes, amp
from ..amp._amp_state import _amp_state
from ..amp.frontend import opt_levels, parse_loss_scale

__all__ = ["AmpPrecision", "MixedPrecision"]


def _unwrap(optimizer):
    """The torch optimizer inside Lightning's ``LightningOptimizer`` (amp patched that one)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class AmpPrecision(Precision):
    """Apex-style mixed precision (``amp.initialize`` / ``amp.scale_loss``) for Lightning's
    Trainer (docs/integrations.md, "Apex dialect: AmpPrecision").

    Args:
        opt_level: ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"`` (as ``amp.initialize``).
        low_precision_dtype: ``torch.float16`` / ``torch.bfloat16`` or a string (``"fp16"``,
            ``"bf16"``, ...); None: amp's default (fp16, as Apex).
        **others: ``loss_scale``, ``min_loss_scale``, ``max_loss_scale``, ``keep_batchnorm_fp32``,
            ``master_weights``, ``cast_model_outputs``, ``num_losses`` and ``verbosity`` go to
            ``amp.initialize`` (``verbosity`` defaults to 0 here: Lightning prints its summary).

    ``connect`` runs ``amp.initialize(model, optimizers, ...)`` on the LightningModule and the
    optimizers of ``configure_optimizers``, before Lightning moves optimizer state or loads a
    checkpoint's (so the fp32 masters come back bit for bit). ``backward`` runs under
    ``amp.scale_loss(loss, optimizer)`` (all optimizers when none is given); in manual optimization
    ``self.manual_backward(loss, loss_id=1)`` picks the loss scaler (with ``num_losses=2``).
    ``optimizer_step`` runs Lightning's closure (forward, backward), then its hooks and gradient
    clipping (on the unscaled fp32 master gradients, ``amp.master_params``), then
    ``optimizer.step()`` without the closure, so the step only sees finished gradients; a
    ``training_step`` that returns None skips the step, as in Lightning's plugins. Checkpoints hold
    ``amp.state_dict()`` (the loss scalers) under ``"AmpPrecision"``; the masters travel in the
    optimizer's state.

    amp's state is process-wide (as with ``amp.initialize``): it stays on after ``fit`` returns
    (O1's casts included), and a later ``amp.initialize`` replaces it. Single-device strategies
    only: Lightning wraps the model for DDP/FSDP before the precision plugin connects, and
    ``amp.initialize`` must see the unwrapped model; with those use :class:`MixedPrecision`.
    """

    def __init__(self, opt_level: str = "O1", low_precision_dtype=None, *, loss_scale=None,
                 min_loss_scale=None, max_loss_scale=2.0**24, keep_batchnorm_fp32=None,
                 master_weights=None, cast_model_outputs=None, num_losses: int = 1,
                 verbosity: int = 0) -> None:
        if opt_level not in opt_levels:
            raise ValueError(f"AmpPrecision: opt_level must be one of 'O0', 'O1', 'O2', 'O3' (the "
                             f"letter O, not zero); got opt_level={opt_level!r}")
        self.opt_level = opt_level
        self.low_precision_dtype = _dtypes.parse_dtype(low_precision_dtype,
                                                       "AmpPrecision: low_precision_dtype")
        if loss_scale is not None:
            parse_loss_scale(loss_scale)  # an error now rather than when fit() starts
        # the rest is checked by amp.initialize in connect(), before it changes anything
        self._initialize_kwargs = dict(
            loss_scale=loss_scale, min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale,
            keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
            cast_model_outputs=cast_model_outputs, num_losses=num_losses, verbosity=verbosity,
            low_precision_dtype=self.low_precision_dtype)
        # Lightning's name for the precision (trainer.precision, logs)
        prefix = "bf16" if self.low_precision_dtype == torch.bfloat16 else "16"
        self.precision = ("32-true" if opt_level == "O0" else
                          f"{prefix}-true" if opt_level == "O3" else f"{prefix}-mixed")
        self._model = None
        self._optimizers: list = []

    def connect(self, model, optimizers, lr_schedulers):
        raw = [_unwrap(o) for o in optimizers]
        if self._model is not None:
            # validate/test/predict after fit reconnect the same module: amp already set it up.
            if model is self._model and all(any(o is p for p in self._optimizers) for o in raw):
                return model, optimizers, lr_schedulers
            raise RuntimeError(
                "AmpPrecision: this plugin already ran amp.initialize for another model or other "
                "optimizers (a second Trainer.fit, or a new module with the same plugin). "
                "amp.initialize takes each model and optimizer once: give each Trainer.fit a new "
                "AmpPrecision and a freshly built LightningModule.")
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            raise RuntimeError(
                f"AmpPrecision: the strategy wrapped the model in {type(model).__name__} before "
                "the precision plugin connected, and amp.initialize needs the unwrapped model. Use "
                "AmpPrecision with a single-device strategy, or peak.integrations.lightning."
                "MixedPrecision (the torch dialect) with DDP/FSDP.")
        amp.initialize(model, raw or None, opt_level=self.opt_level, **self._initialize_kwargs)
        self._model, self._optimizers = model, raw
        return model, optimizers, lr_schedulers

    def backward(self, tensor, model, optimizer, *args, **kwargs) -> None:
        """``manual_backward(loss, loss_id=k, optimizers=opt)``: scaler k, and the optimizer(s)
        that step on this loss (default: every one, each of which an overflow then skips)."""
        loss_id, chosen = kwargs.pop("loss_id", 0), kwargs.pop("optimizers", None)
        if isinstance(chosen, (torch.optim.Optimizer, LightningOptimizer)):
            chosen = [chosen]
        optimizers = ([_unwrap(optimizer)] if optimizer is not None else self._optimizers
                      if chosen is None else [_unwrap(o) for o in chosen])
        with amp.scale_loss(tensor, optimizers, loss_id=loss_id) as scaled_loss:
            model.backward(scaled_loss, *args, **kwargs)

    def optimizer_step(self, optimizer, model, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if isinstance(_unwrap(optimizer), torch.optim.LBFGS):
            raise MisconfigurationException(
                "AmpPrecision: LBFGS re-evaluates its closure inside step(), which amp's loss "
                "scaling cannot follow; use another optimizer or the fp32 default precision.")
        # The closure first, then the step without it: the step reads the loss scale and overflow
        # flag only after the gradients exist, whatever the optimizer does with a closure.
        closure_result = closure()
        self._after_closure(model, optimizer)
        if closure_result is None and model.automatic_optimization:
            return None  # training_step returned None: no backward ran, nothing to step
        return _unwrap(optimizer).step(**kwargs)

    def main_params(self, optimizer):
        """The parameters the optimizer steps: the fp32 masters under O2 (what clipping clips)."""
        return amp.master_params(_unwrap(optimizer))

    def state_dict(self) -> dict[str, Any]:
        if self._model is None or not _amp_state.initialized:
            return {}
        return {"amp": amp.state_dict(), "opt_level": self.opt_level,
                "low_precision_dtype": str(_amp_state.opt_properties.low_precision_dtype)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = (state_dict.get("opt_level"), state_dict.get("low_precision_dtype"))
        here = (self.opt_level, str(_amp_state.opt_properties.low_precision_dtype))
        if saved != here:
            raise ValueError(
                f"AmpPrecision: the checkpoint was written under opt_level={saved[0]!r} with "
                f"low_precision_dtype={saved[1]}, this plugin runs opt_level={here[0]!r} with "
                f"low_precision_dtype={here[1]}; resume with AmpPrecision({saved[0]!r}, ...) and "
                "the checkpoint's dtype (amp's loss scale and master weights belong to them).")
        amp.load_state_dict(state_dict["amp"])


def _mixed_dtype(precision) -> torch.dtype:
    """Lightning's precision names, or anything peak's dtype parser reads as fp16/bf16."""
    lightning_names = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
    if isinstance(precision, str) and precision in lightning_names:
        return lightning_names[precision]
    try:
        return _dtypes.parse_dtype(precision, "MixedPrecision: precision", allow_none=False)
    except _dtypes.DtypeArgumentError:
        strings = ", ".join(repr(n) for d in _dtypes.LOW_PRECISION for n in _dtypes.DTYPE_NAMES[d])
        raise ValueError(f"MixedPrecision: precision must be '16-mixed' or 'bf16-mixed' "
                         f"(Lightning's names), torch.float16, torch.bfloat16, or one of the "
                         f"strings {strings}; got precision={precision!r}") from None


class MixedPrecision(_LightningMixedPrecision):
    """Lightning's ``MixedPrecision`` on peak's torch dialect: ``peak.amp.autocast`` for every
    step (with per-region ``fp32_ops`` / ``lower_ops`` list edits) and, for fp16,
    ``peak.amp.GradScaler`` (hysteresis, a scale floor and ceiling, ``overflow_report()``).

    Args:
        precision: ``"16-mixed"`` / ``"bf16-mixed"`` (Lightning's names), or a dtype or dtype
            string (``"fp16"``, ``"bf16"``, ``torch.bfloat16``, ...).
        device: the autocast device type; None: the model's device type, read when Lightning
            connects the model.
        scaler: a GradScaler for fp16; None: ``peak.amp.GradScaler(device)`` with torch's
            defaults. bf16 takes none (as Lightning's plugin).
        fp32_ops, lower_ops: ops to run in fp32 / in the low dtype inside the steps (as
            ``peak.amp.autocast``).

    The scaler's state goes into checkpoints under ``"MixedPrecision"``, as with Lightning's
    plugin. Autocast runs with ``cache_enabled=False``, as Lightning's.
    """

    def __init__(self, precision="bf16-mixed", device: str | None = None, scaler=None, *,
                 fp32_ops=None, lower_ops=None) -> None:
        self._dtype = _mixed_dtype(precision)
        self.precision = "bf16-mixed" if self._dtype == torch.bfloat16 else "16-mixed"
        if scaler is not None and self._dtype == torch.bfloat16:
            raise MisconfigurationException(f"MixedPrecision: bf16 needs no loss scaling (fp32's "
                                            f"range); pass scaler=None, found {scaler}.")
        if device is not None and not isinstance(device, str):
            raise TypeError(f"MixedPrecision: device must be a device type string ('cpu', 'cuda') "
                            f"or None; got device={device!r}")
        self.device, self.scaler = device, scaler
        self._fp32_ops, self._lower_ops = fp32_ops, lower_ops
        # check the list edits now (an unknown op name raises here, not in the first step)
        amp.autocast("cpu", dtype=torch.bfloat16, enabled=False, fp32_ops=fp32_ops,
                     lower_ops=lower_ops)

    def connect(self, model, optimizers, lr_schedulers):
        if self.device is None:
            param = next(model.parameters(), None)
            self.device = param.device.type if param is not None else "cpu"
        _dtypes.warn_if_slow_fp16(self._dtype, self.device, fix='MixedPrecision("bf16-mixed")')
        if self.scaler is None and self._dtype == torch.float16:
            self.scaler = amp.GradScaler(self.device)
        return super().connect(model, optimizers, lr_schedulers)

    def autocast_context_manager(self):
        return amp.autocast(self.device or "cpu", dtype=self._dtype, cache_enabled=False,
                            fp32_ops=self._fp32_ops, lower_ops=self._lower_ops)
