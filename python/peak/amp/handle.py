"""``amp.scale_loss``; ``LossScaler``, Apex's per-loss scaler (a front door over
``peak.scaling.LossScale``, docs/amp_api.md, "Loss scaler"); the O1 handle
(``amp._amp_state.handle``, what the legacy ``amp.init`` returns); ``amp.disable_casts``."""

from __future__ import annotations

import contextlib
import math
import operator
import threading
import warnings
from collections import OrderedDict
from typing import Sequence

import torch

from peak import ops
from peak.optimizers.masters import inner_optimizer
from peak.scaling import (LossScale, agree_on_overflow, check_scale, core_attribute,
                          group_by_device_dtype, merge_flags, unscale_grads_)

from . import _caster
from ._amp_state import _amp_state
from ._process_optimizer import process_optimizer
from .._stacklevel import user_stacklevel


class LossScaler:
    """Dynamic (``loss_scale="dynamic"``) or static loss scaling for one loss, on ``device``.
    Its state is the core's device tensors (``scale``, ``growth_tracker``, ``hysteresis_tracker``,
    ``found_inf``), changed only on the device; ``update_scale`` reads the overflow flag once."""

    def __init__(self, loss_scale="dynamic", init_scale: float = 2.0**16,
                 scale_factor: float = 2.0, scale_window: int = 2000,
                 min_loss_scale: float | None = None, max_loss_scale: float | None = 2.0**24, *,
                 backoff_factor: float = 0.5, hysteresis: int = 1,
                 device: torch.device | str | None = None) -> None:
        self.dynamic = loss_scale == "dynamic"
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        # Apex treats min_loss_scale None and 0 alike ("no floor").
        floor = float(min_loss_scale) if min_loss_scale else 0.0
        ceiling = float(max_loss_scale) if max_loss_scale is not None else math.inf
        self._static_value = None if self.dynamic else float(loss_scale)
        self.update_count = 0
        initial = min(ceiling, float(init_scale)) if self.dynamic else float(loss_scale)
        self._core = LossScale(initial, growth_factor=float(scale_factor),
                               backoff_factor=float(backoff_factor),
                               growth_interval=int(scale_window), hysteresis=int(hysteresis),
                               min_scale=floor, max_scale=ceiling, device=self.device)
        # The core's tensors under Apex's names (the same objects: they change only in place).
        self.scale, self.growth_tracker, self.hysteresis_tracker = (
            self._core.scale, self._core.growth_tracker, self._core.hysteresis_tracker)
        self.found_inf = self._core.found_inf.for_device(self.device)

    (growth_factor, backoff_factor, growth_interval, hysteresis, min_loss_scale,
     max_loss_scale) = map(core_attribute, ("growth_factor", "backoff_factor", "growth_interval",
                                            "hysteresis", "min_scale", "max_scale"))

    def loss_scale(self) -> float:
        """The current scale as a Python float (a host sync for a dynamic scaler)."""
        return self._static_value if self._static_value is not None else float(self.scale.item())

    def is_static_one(self) -> bool:
        """True for a static scale of exactly 1.0 (known on the host, no sync)."""
        return self._static_value == 1.0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss.float() * S`` without reading S on the host."""
        if self._static_value is not None:
            return loss.float() * self._static_value
        return loss.float() * self.scale.to(loss.device, non_blocking=True).reshape(())

    def _set_loss_scale(self, value: float) -> None:
        self.scale.fill_(value := check_scale("a loss scaler's _loss_scale", float(value)))
        self._static_value = None if self.dynamic else value

    # Apex's private names, which its tests and scripts set (``loss_scalers[0]._loss_scale = 4``;
    # NVIDIA's BERT sets its own ``_overflow_buf`` for ``update_scale()``: taken into the flag).
    _loss_scale = property(lambda self: self.loss_scale(), _set_loss_scale)
    _scale_seq_len, _min_loss_scale, _max_loss_scale = (growth_interval, min_loss_scale,
                                                        max_loss_scale)
    _unskipped = property(lambda self: int(self.growth_tracker.item()),
                          lambda self, value: self.growth_tracker.fill_(int(value)))
    _overflow_buf = property(lambda self: self.found_inf, lambda self, buf: None if buf is
                             self.found_inf else self.found_inf.copy_(buf.reshape(1)))
    _has_overflow = property(lambda self: self.has_overflow(), lambda self, value: self.found_inf
                             .fill_(1.0) if value else self.clear_overflow_state())

    def found_inf_for(self, device: torch.device) -> torch.Tensor:
        """The overflow flag the kernels write for tensors on ``device``."""
        return self._core.found_inf.for_device(device)

    def found_inf_on(self, device: torch.device) -> torch.Tensor:
        """The flags merged into a new 0/1 flag on ``device`` (no host read), for a step."""
        return merge_flags(self._core.found_inf.values(), device, (1,))

    def clear_overflow_state(self) -> None:
        self._core.found_inf.zero_()

    def has_overflow(self) -> bool:
        """Host read of the overflow flags (a sync)."""
        return self._core.found_inf.any_()

    def check(self, grads: Sequence[torch.Tensor]) -> None:
        """Flag inf/NaN in ``grads`` (nothing written)."""
        unscale_grads_(list(grads), 1.0, self._core.found_inf, check_only=True)

    def _inv_scale(self, scale_override=None):
        if scale_override is None and self._static_value is None:
            return self._core.inv_scale()
        return 1.0 / float(self._static_value if scale_override is None else scale_override)

    def unscale(self, model_grads: Sequence[torch.Tensor], master_grads: Sequence[torch.Tensor],
                scale_override=None) -> None:
        """``master_grads[i] = model_grads[i] / S``, flagging inf/NaN (a list twice: in place)."""
        outputs = None if model_grads is master_grads else list(master_grads)
        unscale_grads_(list(model_grads), self._inv_scale(scale_override), self._core.found_inf,
                       outputs=outputs)

    def unscale_with_stashed(self, model_grads: Sequence[torch.Tensor],
                             stashed_grads: Sequence[torch.Tensor],
                             out_grads: Sequence[torch.Tensor]) -> None:
        """``out[i] = model_grads[i] / S + stashed_grads[i]``; only the new ``model_grads`` are
        checked for inf/NaN (the stash was checked when it was unscaled)."""
        inv_scale = self._inv_scale()
        for device, _, _, (xs, ys, outs) in group_by_device_dtype(model_grads, stashed_grads,
                                                                  out_grads):
            inv = inv_scale.to(device) if isinstance(inv_scale, torch.Tensor) else inv_scale
            ops.multi_tensor_axpby_(xs, ys, outs, inv, 1.0, self.found_inf_for(device), check="x")

    def update(self) -> None:
        """Update the scale on the device from the overflow flags (no host sync)."""
        self.update_count += 1  # (the scale may differ from here: known without a host read)
        if self.dynamic:
            self._core.update()
        else:  # a static scaler never looks at overflows, only counts updates (Apex's _unskipped)
            self.growth_tracker.add_(1)

    def update_scale(self) -> bool:
        """Apex's ``update_scale``: update S and return whether the step must be skipped (for a
        dynamic scaler one host read of the overflow flag: the one sync of ``scale_loss``)."""
        should_skip = self.dynamic and self.has_overflow()
        self.update()
        return should_skip

    def state_dict(self) -> dict:
        """Apex format: ``{"loss_scale": float, "unskipped": int}``."""
        return OrderedDict(loss_scale=self.loss_scale(), unskipped=self._unskipped)

    def load_state_dict(self, state: dict) -> None:
        if self.dynamic or float(state["loss_scale"]) == self.loss_scale():
            self._loss_scale = state["loss_scale"]
        else:  # the user's explicit static scale wins over the checkpoint's
            warnings.warn(f"amp.load_state_dict: the static loss scale {self.loss_scale()} stays, "
                          f"the saved {state['loss_scale']} is not loaded",
                          stacklevel=user_stacklevel())  # via amp.load_state_dict or not
        self._unskipped = state["unskipped"]
        self.hysteresis_tracker.fill_(self.hysteresis)
        self.clear_overflow_state()

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return (f"LossScaler({kind}, scale={self.loss_scale()}, unskipped={self._unskipped}, "
                f"device={self.device})")


def _check_optimizers(optimizers) -> list:
    if isinstance(optimizers, (list, tuple)):
        optimizers = list({id(o): o for o in map(inner_optimizer, optimizers)}.values())  # once
    elif isinstance(inner_optimizer(optimizers), torch.optim.Optimizer):
        optimizers = [inner_optimizer(optimizers)]
    else:
        raise TypeError("amp.scale_loss: optimizers must be an optimizer or a list of optimizers "
                        f"(those returned by amp.initialize), got {type(optimizers).__name__}")
    for i, opt in enumerate(optimizers):
        name = type(opt).__name__
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"amp.scale_loss: optimizers[{i}] is a {name}, not a torch optimizer")
        stash = getattr(opt, "_amp_stash", None)
        if stash is None:
            raise RuntimeError(
                f"amp.scale_loss: optimizer {name} was not passed through amp.initialize; pass "
                "it: model, optimizer = amp.initialize(model, optimizer, opt_level=...)")
        if stash.generation != _amp_state.generation:
            raise RuntimeError(
                f"amp.scale_loss: optimizer {name} was passed through an earlier amp.initialize "
                "call with other options than the latest amp.initialize, which replaced them; to "
                "train both, pass every model and optimizer to one call (or use the same options).")
    return optimizers


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False,
               delay_overflow_check=False):
    """Context manager yielding ``loss.float() * S``, S the current scale of scaler ``loss_id``::

        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()

    On exit the gradients the backward pass produced are unscaled (into the fp32 master gradients
    under O2) and added to those of earlier backward passes of this step. If a dynamic scaler
    finds an inf/NaN gradient, the scale is reduced and the next ``step()`` of every optimizer
    passed here is skipped, leaving weights, master weights and optimizer state untouched.

    Args:
        loss: a scalar tensor.
        optimizers: every optimizer (from ``amp.initialize``) owning a parameter given a gradient.
        loss_id: which loss scaler (``0 <= loss_id < num_losses``).
        model: unused (reserved, as in Apex).
        delay_unscale: leave the gradients scaled and unchecked (gradient accumulation); do not
            call ``step()`` before a later ``scale_loss`` without it.
        delay_overflow_check: unscale, but neither check for overflow nor update the scale.
    """
    # (Nested, the outer exit would unscale the inner's gradients again.)
    if getattr(_open_block, "open", False) and _amp_state.enabled:
        raise RuntimeError("amp.scale_loss blocks do not nest: exit one (after its backward) "
                           "before entering the next, one block per loss (loss_id=...)")
    _open_block.open = True
    try:
        yield from _scale_loss(loss, optimizers, loss_id, delay_unscale, delay_overflow_check)
    finally:
        _open_block.open = False
        _caster.clear_cache()  # the O1 weight-cast cache lives for one iteration (as Apex)


_open_block = threading.local()


def _scale_loss(loss, optimizers, loss_id, delay_unscale, delay_overflow_check):
    if not _amp_state.initialized:
        raise RuntimeError("Invoked 'with amp.scale_loss`, but internal Amp state has not been "
                           "initialized.  model, optimizer = amp.initialize(model, optimizer, "
                           "opt_level=...) must be called before `with amp.scale_loss`.")
    if not _amp_state.opt_properties.enabled:
        yield loss
        return
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"amp.scale_loss: loss must be a torch.Tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(f"amp.scale_loss: loss must be a scalar (one element), got shape "
                         f"{tuple(loss.shape)}; reduce it first, e.g. loss.mean() or loss.sum()")
    optimizers = _check_optimizers(optimizers)
    scalers = _amp_state.loss_scalers
    if isinstance(loss_id, bool) or not hasattr(type(loss_id), "__index__") or not (
            0 <= operator.index(loss_id) < len(scalers)):  # (an int, or numpy's)
        raise IndexError(f"amp.scale_loss: loss_id={loss_id!r} but amp.initialize(num_losses="
                         f"{len(scalers)}) created loss scalers 0..{len(scalers) - 1}; pass "
                         "num_losses=<number of losses> to amp.initialize (loss_id: an int).")
    scaler = scalers[operator.index(loss_id)]
    stashes = [opt._amp_stash for opt in optimizers]
    for stash in stashes:  # gradients a delayed exit left scaled by another loss's scaler
        stash.follow_scaler(scaler)
    if not _amp_state.opt_properties.master_weights and scaler.is_static_one():
        # The fp32 path (nothing to scale, no masters); its update still counts (``unskipped``).
        yield loss.float()
        if not delay_unscale and not delay_overflow_check:
            scaler.update()
        return
    prepared = [stash for stash in stashes  # fused ones; others unless gradients stay scaled
                if stash.consumes_scaled_grads or not stash.params_have_scaled_gradients]
    for stash in prepared:
        stash.prepare_backward(scaler)
    dist = torch.distributed  # (warned once per line of the script: the default filter)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and any(
            s.accumulating for s in prepared):
        warnings.warn("amp.scale_loss: the step's earlier gradients are set aside during this "
                      "backward; if they came under DDP's no_sync(), they never reach the "
                      "all-reduce: use delay_unscale=True on all micro-batches but the last "
                      "(docs/distributed.md)", stacklevel=user_stacklevel())
    try:
        yield scaler.scaled(loss)
    except BaseException:
        for stash in prepared:  # e.g. a failed backward: put the earlier gradients back
            stash.abort_backward()
        raise
    if delay_unscale:
        for stash in stashes:
            stash.params_have_scaled_gradients = True
            stash.delayed_scale = (scaler, scaler.update_count, scaler.scale.clone())
        return
    scaler.clear_overflow_state()
    got_grads = False
    for stash in stashes:
        got_grads |= stash.post_backward(scaler)
        stash.params_have_scaled_gradients, stash.delayed_scale = False, None
    if not got_grads and not stashes[0].warned_no_grads:
        stashes[0].warned_no_grads = True
        warnings.warn("amp.scale_loss: the backward pass gave none of the optimizer's parameters "
                      "a gradient, so step() changes nothing: pass the optimizer(s) owning the "
                      "loss's parameters. Parameters replaced after amp.initialize (as FSDP2's "
                      "fully_shard does) are not the optimizer's: fully_shard first, then "
                      "opt_level='O1' (docs/distributed.md)",
                      stacklevel=user_stacklevel())  # the script's with line
    if delay_overflow_check:
        return
    if scaler.dynamic and any(stash.sharded for stash in stashes):
        # FSDP2's gradient shards: one rank's inf must skip every rank (flags all-reduced, MAX)
        agree_on_overflow(next(s for s in stashes if s.sharded).optimizer, scaler._core.found_inf)
    if all(stash.skips_on_device() for stash in stashes):
        # Every step takes found_inf: the skip is decided on the device, no host read.
        scaler.update()
        if scaler.dynamic:
            for stash in stashes:
                stash.note_overflow(loss_id, scaler)
    elif scaler.update_scale():  # the one host read, for optimizers that cannot skip on the device
        for stash in stashes:
            if stash.pending_skip is None:
                stash.pending_skip = (loss_id, scaler)


disable_casts = _caster.disabled  # amp.disable_casts


class AmpHandle:
    """The O1 handle (``amp._amp_state.handle``) and what the deprecated ``amp.init()`` returns."""

    has_cache = True

    def __init__(self, legacy: bool = False) -> None:
        self._legacy, self._default_device = legacy, None

    # Apex's handle methods: the O1 caster's functions.
    is_active = staticmethod(_caster.is_enabled)
    _disable_casts = staticmethod(disable_casts)
    _deactivate = staticmethod(_caster.disable)
    _clear_cache = staticmethod(_caster.clear_cache)

    verbose = property(lambda self: _amp_state.verbosity >= 2)

    def scale_loss(self, loss, optimizer, loss_id: int = 0):
        """``amp.scale_loss``; a legacy handle registers unknown optimizers on first use."""
        if self._legacy and _amp_state.initialized and _amp_state.opt_properties.enabled:
            opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
            for opt in opts:
                if getattr(opt, "_amp_stash", None) is None:
                    self._register(opt)
        return scale_loss(loss, optimizer, loss_id=loss_id)

    def _register(self, optimizer) -> None:
        if self._default_device is None:
            # put the scaler state next to the parameters (amp.init() saw no model)
            self._default_device = device = next(
                (p.device for g in optimizer.param_groups for p in g["params"]),
                torch.device("cpu"))
            if device != _amp_state.loss_scalers[0].device:
                _amp_state.loss_scalers[0] = LossScaler(
                    _amp_state.opt_properties.loss_scale, min_loss_scale=_amp_state.min_loss_scale,
                    max_loss_scale=_amp_state.max_loss_scale, device=device)
        process_optimizer(optimizer, _amp_state.opt_properties)

    def wrap_optimizer(self, optimizer, num_loss: int = 1):
        raise NotImplementedError(
            "amp_handle.wrap_optimizer is not supported. Use model, optimizer = amp.initialize("
            "model, optimizer, opt_level='O1', num_losses=N) and `with amp.scale_loss(loss, "
            "optimizer, loss_id=i)`.")


class NoOpHandle:
    has_cache = verbose = False
    _disable_casts = staticmethod(contextlib.nullcontext)
    is_active = staticmethod(lambda: False)
    _clear_cache = _deactivate = staticmethod(lambda: None)
    wrap_optimizer = AmpHandle.wrap_optimizer  # (the optimizer itself lacked scale_loss)
    scale_loss = staticmethod(lambda loss, optimizer, loss_id=0: contextlib.nullcontext(loss))
