"""peak with Hugging Face Accelerate (tested with accelerate 1.15.0), both dialects
(docs/integrations.md, "Accelerate"): the Apex dialect (:func:`prepare` or :func:`initialize`,
then :func:`backward`) leaves the ``Accelerator`` at ``mixed_precision="no"``; the torch dialect
(:func:`use_grad_scaler`, :func:`autocast`) follows its ``mixed_precision="fp16"|"bf16"``.
"""
from __future__ import annotations

import torch
from accelerate.optimizer import AcceleratedOptimizer

from .. import _dtypes, amp

__all__ = ["initialize", "prepare", "backward", "unwrap_optimizer", "use_grad_scaler", "autocast"]


def unwrap_optimizer(optimizer):
    """The torch optimizer inside any number of ``AcceleratedOptimizer`` wrappers."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _as_list(objects):
    return list(objects) if isinstance(objects, (list, tuple)) else [objects]


def initialize(accelerator, models, optimizers=None, **amp_kwargs):
    """``amp.initialize(models, optimizers, **amp_kwargs)`` in a script that uses Accelerate,
    before or after ``accelerator.prepare`` (single process): prepared optimizers
    (``AcceleratedOptimizer``) are unwrapped, and the objects passed in come back, wrappers
    included, in the shape passed in. Registers amp's loss-scaler state with
    ``accelerator.register_for_checkpointing`` (once per accelerator), so ``save_state`` /
    ``load_state`` carry it; the masters are in the optimizer's state already.

    The Accelerator must be at ``mixed_precision="no"``: amp's opt_level does the mixed precision,
    and Accelerate's autocast and GradScaler on top would do it twice. In multi-process runs call
    it before ``accelerator.prepare`` (DDP must wrap the model after ``amp.initialize``).
    """
    mixed = accelerator.mixed_precision
    if mixed != "no" or accelerator.scaler is not None or accelerator.native_amp:
        raise ValueError(
            f"peak.integrations.accelerate.initialize: the Accelerator runs mixed_precision="
            f"{mixed!r}, and amp's opt_level would cast on top of Accelerate's autocast and "
            "GradScaler. Create it as Accelerator(mixed_precision='no') (the default) and choose "
            "the precision with opt_level= and low_precision_dtype= here; or keep Accelerate's "
            "mixed precision and use peak's torch dialect (use_grad_scaler).")
    model_list = _as_list(models)
    for i, model in enumerate(model_list):
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            raise RuntimeError(
                f"peak.integrations.accelerate.initialize: models[{i}] was already wrapped in "
                f"{type(model).__name__} by accelerator.prepare, and amp.initialize must see the "
                "model before the wrapper registers its parameters. Call initialize(accelerator, "
                "model, optimizer, ...) first, then accelerator.prepare(model, optimizer, ...).")
    inner = None if optimizers is None else [unwrap_optimizer(o) for o in _as_list(optimizers)]
    amp.initialize(model_list, inner, **amp_kwargs)
    if not getattr(accelerator, "_peak_amp_state_registered", False):
        accelerator.register_for_checkpointing(amp)  # amp.state_dict(): the loss scalers
        accelerator._peak_amp_state_registered = True
    return models if optimizers is None else (models, optimizers)


def prepare(accelerator, *objects, opt_level: str, **amp_kwargs):
    """:func:`initialize` on the models and optimizers among ``objects``, then
    ``accelerator.prepare(*objects)``; returns what ``prepare`` returns::

        model, optimizer, loader = peak_accelerate.prepare(
            accelerator, model, optimizer, loader, opt_level="O2", low_precision_dtype="bf16")
    """
    models = [o for o in objects if isinstance(o, torch.nn.Module)]
    optimizers = [o for o in objects if isinstance(o, torch.optim.Optimizer)]
    if not models:
        raise ValueError("peak.integrations.accelerate.prepare: no torch.nn.Module among the "
                         "objects; pass the model(s) and optimizer(s) to prepare, as to "
                         "accelerator.prepare.")
    initialize(accelerator, models, optimizers or None, opt_level=opt_level, **amp_kwargs)
    return accelerator.prepare(*objects)


def backward(accelerator, loss, optimizers, *, loss_id: int = 0,
             delay_unscale: bool | None = None, **kwargs):
    """``accelerator.backward(loss)`` for the Apex dialect: the loss is scaled by amp for
    ``optimizers`` (prepared or not) and the gradients unscaled into them on the way out::

        with amp.scale_loss(loss, optimizers, loss_id=loss_id,
                            delay_unscale=delay_unscale) as scaled_loss:
            accelerator.backward(scaled_loss, **kwargs)

    ``delay_unscale=None`` (the default) is True on a micro-batch ``accelerator.accumulate()``
    runs under DDP's ``no_sync()`` (a distributed run, ``sync_gradients`` False, no
    ``sync_each_batch``), whose gradients must stay in ``.grad``, scaled, for the last
    micro-batch's all-reduce (docs/distributed.md, "Gradient accumulation under DDP"); False
    otherwise. Inside ``accelerator.no_sync(model)`` written by hand, pass ``True``."""
    if delay_unscale is None:  # (accumulate()'s own condition for entering no_sync)
        delay_unscale = accelerator.use_distributed and not (
            accelerator.sync_gradients
            or accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False))
    inner = [unwrap_optimizer(o) for o in _as_list(optimizers)]
    with amp.scale_loss(loss, inner, loss_id=loss_id, delay_unscale=delay_unscale) as scaled_loss:
        accelerator.backward(scaled_loss, **kwargs)


def _dtype_of(accelerator) -> torch.dtype:
    mixed = accelerator.mixed_precision
    if mixed not in ("fp16", "bf16"):
        raise ValueError(
            f"peak's torch dialect with Accelerate follows Accelerator(mixed_precision=...), which "
            f"is {mixed!r} here; create the Accelerator with mixed_precision='fp16' or 'bf16' (or "
            "use the Apex dialect: peak.integrations.accelerate.initialize with an opt_level).")
    return _dtypes.parse_dtype(mixed, "Accelerator.mixed_precision")


def use_grad_scaler(accelerator, scaler=None):
    """Make the Accelerator scale fp16 losses with ``peak.amp.GradScaler``; call it before
    ``accelerator.prepare`` (the prepared optimizer keeps the scaler it was given).

    ``scaler``: a ``peak.amp.GradScaler`` to use (hysteresis, ``min_scale``, ...); None: one with
    the settings of Accelerate's ``GradScalerKwargs`` if given, else torch's defaults. On the CPU,
    where Accelerate leaves ``mixed_precision="fp16"`` without autocast or scaler, this also turns
    Accelerate's fp16 autocast on. With ``mixed_precision="bf16"`` no scaler is needed: returns
    None and changes nothing (pass no scaler). Returns the scaler in use.
    """
    dtype = _dtype_of(accelerator)
    kind = str(accelerator.distributed_type).rsplit(".", 1)[-1]
    if kind in ("DEEPSPEED", "MEGATRON_LM") or (kind == "FSDP" and not accelerator.is_fsdp2):
        raise ValueError(
            f"use_grad_scaler: under {kind} the loss scaling belongs to "
            f"{'FSDP1 (ShardedGradScaler)' if kind == 'FSDP' else kind}; peak's GradScaler takes "
            "single-process, DDP and FSDP2 (fully_shard) runs.")
    if accelerator._models or accelerator._optimizers:
        raise RuntimeError(
            "peak.integrations.accelerate.use_grad_scaler: call it before accelerator.prepare; "
            "the prepared optimizers and models already hold Accelerate's scaler and autocast.")
    if dtype == torch.bfloat16:
        if scaler is not None:
            raise ValueError("use_grad_scaler: bf16 needs no loss scaling (it has fp32's range); "
                             "pass no scaler.")
        return None
    if scaler is not None and not isinstance(scaler, amp.GradScaler):
        raise TypeError(f"use_grad_scaler: scaler must be a peak.amp.GradScaler or None; got "
                        f"{type(scaler).__name__}")
    device_type = accelerator.device.type
    if scaler is None:
        handler = accelerator.scaler_handler
        scaler = amp.GradScaler(device_type, **(handler.to_kwargs() if handler is not None else {}))
    accelerator.scaler = scaler
    # Accelerate turns fp16 autocast on only off the CPU; its forward wrapper and backward follow
    # these two attributes.
    accelerator.native_amp = True
    _dtypes.warn_if_slow_fp16(dtype, device_type, fix='Accelerator(mixed_precision="bf16")')
    return scaler


def autocast(accelerator, *, fp32_ops=None, lower_ops=None, enabled: bool = True):
    """``accelerator.autocast()`` as a ``peak.amp.autocast`` (the Accelerator's device type and
    mixed-precision dtype), with per-region list edits::

        with peak_accelerate.autocast(accelerator, fp32_ops=[torch.nn.functional.softmax]):
            loss = loss_fn(model(x), y)
    """
    return amp.autocast(accelerator.device.type, dtype=_dtype_of(accelerator), enabled=enabled,
                        fp32_ops=fp32_ops, lower_ops=lower_ops)
