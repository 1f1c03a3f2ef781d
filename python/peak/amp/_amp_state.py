"""The global state of the Apex dialect (``amp._amp_state``: scripts poke at its Apex names, so
they are kept), its print/error/log helpers and ``amp.master_params``."""

from __future__ import annotations

import logging

import torch

# Machine-readable events at INFO (docs/logging.md), one line each: key=value pairs.
logger = logging.getLogger("peak.amp")
LOW_DTYPES = (torch.float16, torch.bfloat16)


class AmpState:
    def __init__(self) -> None:
        # Escape hatches kept from Apex.
        self.hard_override = False  # turn property-validation errors into printed warnings
        self.allow_incoming_model_not_fp32 = False  # skip the "model is already half" check
        self.verbosity = 1
        self.reset()

    def reset(self) -> None:
        """Forget what a previous ``initialize`` set up (called at the start of ``initialize``)."""
        self.__dict__.pop("opt_properties", None)
        self.loss_scalers: list = []
        self.min_loss_scale = None
        self.max_loss_scale = 2.0**24
        self.handle = None
        # Optimizers of an earlier generation are stale (initialize keeps it for the same options).
        self.generation = getattr(self, "generation", 0) + 1

    initialized = property(lambda self: hasattr(self, "opt_properties"))
    enabled = property(lambda self: self.initialized and bool(self.opt_properties.enabled))


_amp_state = AmpState()


def warn_or_err(msg: str, exc_type: type = RuntimeError) -> None:
    if _amp_state.hard_override:
        print("Warning:  " + msg)
    else:
        raise exc_type(msg)


def maybe_print(msg: str, rank0: bool = False) -> None:
    dist = torch.distributed
    if _amp_state.verbosity > 0 and not (rank0 and dist.is_available() and dist.is_initialized()
                                         and dist.get_rank() != 0):
        print(msg)


def log_skip_step(step: int, loss_id: int, loss_scale: float, optimizer: str) -> None:
    """Log a step skipped because of an inf/NaN gradient (the record's format: docs/logging.md)."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("event=skip_step step=%d loss_id=%d loss_scale=%r optimizer=%s",
                    step, loss_id, float(loss_scale), optimizer)


def master_params(optimizer):
    """Generator over the parameters the optimizer steps: the fp32 master weights under O2,
    otherwise the model's own parameters (``requires_grad=False`` ones included, as in Apex).
    For clipping after ``scale_loss`` exits: ``clip_grad_norm_(amp.master_params(opt), 1.0)``."""
    stash = getattr(optimizer, "_amp_stash", None)  # (a fused optimizer's: fp32 grads here)
    yield from (stash.master_params() if stash is not None
                else (p for group in optimizer.param_groups for p in group["params"]))
