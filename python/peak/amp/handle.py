"""``amp.scale_loss``, ``amp.disable_casts`` and the legacy handle API (``amp.init``)."""

from __future__ import annotations

import contextlib
import warnings

import torch

from . import _caster
from ._amp_state import _amp_state
from ._options import O1, Properties
from ._process_optimizer import inner_optimizer, process_optimizer
from .loss_scaler import LossScaler

_NOT_INITIALIZED = (
    "Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized.  "
    "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called before `with amp.scale_loss`.")


def _check_optimizers(optimizers) -> list:
    if isinstance(optimizers, (list, tuple)):
        optimizers = [inner_optimizer(o) for o in optimizers]
        optimizers = list({id(o): o for o in optimizers}.values())  # each once, in order
    elif isinstance(inner_optimizer(optimizers), torch.optim.Optimizer):
        optimizers = [inner_optimizer(optimizers)]
    else:
        raise TypeError(
            "amp.scale_loss: optimizers must be an optimizer or a list of optimizers (those returned by "
            f"amp.initialize), got {type(optimizers).__name__}")
    for i, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"amp.scale_loss: optimizers[{i}] is a {type(opt).__name__}, not a torch optimizer")
        stash = getattr(opt, "_amp_stash", None)
        if stash is None:
            raise RuntimeError(
                f"amp.scale_loss: optimizer {type(opt).__name__} was not passed through amp.initialize; pass it: "
                "model, optimizer = amp.initialize(model, optimizer, opt_level=...)")
        if stash.generation != _amp_state.generation:
            raise RuntimeError(
                f"amp.scale_loss: optimizer {type(opt).__name__} was passed through an earlier amp.initialize "
                "call, whose state has been replaced; use the optimizer (and model) passed to the latest "
                "amp.initialize.")
    return optimizers


def _check_loss(loss) -> None:
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"amp.scale_loss: loss must be a torch.Tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(
            f"amp.scale_loss: loss must be a scalar (one element), got shape {tuple(loss.shape)}; reduce it "
            "first, e.g. loss.mean() or loss.sum()")


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False, delay_overflow_check=False):
    """Context manager yielding ``loss.float() * S`` (S = the current scale of loss scaler ``loss_id``)::

        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()

    On exit the gradients the backward pass produced are unscaled (into the fp32 master gradients under
    O2) and added to those of earlier backward passes of this step.  If a dynamic scaler finds an inf/NaN
    gradient, the scale is reduced and the next ``step()`` of every optimizer passed here is skipped,
    leaving weights, master weights and optimizer state untouched.

    Args:
        loss: a scalar tensor.
        optimizers: every optimizer (from ``amp.initialize``) owning a parameter that gets a gradient.
        loss_id: which loss scaler (``0 <= loss_id < num_losses``).
        model: unused (reserved, as in Apex).
        delay_unscale: leave the gradients scaled and unchecked (gradient accumulation); do not call
            ``step()`` before a later ``scale_loss`` without it.
        delay_overflow_check: unscale, but neither check for overflow nor update the scale.
    """
    try:
        with _scale_loss(loss, optimizers, loss_id, model, delay_unscale, delay_overflow_check) as scaled:
            yield scaled
    finally:
        _caster.clear_cache()  # the O1 weight-cast cache lives for one iteration (as Apex)


@contextlib.contextmanager
def _scale_loss(loss, optimizers, loss_id, model, delay_unscale, delay_overflow_check):
    if not _amp_state.initialized:
        raise RuntimeError(_NOT_INITIALIZED)
    if not _amp_state.opt_properties.enabled:
        yield loss
        return
    _check_loss(loss)
    optimizers = _check_optimizers(optimizers)
    scalers = _amp_state.loss_scalers
    if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < len(scalers):
        raise IndexError(
            f"amp.scale_loss: loss_id={loss_id!r} but amp.initialize(num_losses={len(scalers)}) created loss "
            f"scalers 0..{len(scalers) - 1}; pass num_losses=<number of losses> to amp.initialize.")
    scaler = scalers[loss_id]
    stashes = [opt._amp_stash for opt in optimizers]

    if not _amp_state.opt_properties.master_weights and scaler.is_static_one():
        # Nothing to scale or unscale and no master gradients to fill: the fp32 path. The update
        # is still counted (``unskipped`` in amp.state_dict()), as at every other opt_level.
        yield loss.float()
        if not delay_unscale and not delay_overflow_check:
            scaler.update()
        return

    prepared = []
    if not delay_unscale:
        prepared = [stash for stash in stashes
                    if not stash.params_have_scaled_gradients and not stash.fused]
        for stash in prepared:
            stash.prepare_backward()
    for stash in stashes:
        if stash.fused:
            stash.fused_prepare_backward(scaler)

    try:
        yield scaler.scaled(loss)
    except BaseException:
        for stash in prepared:  # e.g. a failed backward: put the earlier gradients back
            stash.abort_backward()
        for stash in stashes:
            if stash.fused:
                stash.fused_abort_backward()
        raise

    if delay_unscale:
        for stash in stashes:
            stash.params_have_scaled_gradients = True
        return
    scaler.clear_overflow_state()
    for stash in stashes:
        if stash.fused:
            stash.fused_post_backward(scaler)
        else:
            stash.post_backward(scaler)
        stash.params_have_scaled_gradients = False
    should_skip = False if delay_overflow_check else scaler.update_scale()
    if should_skip:
        for stash in stashes:
            if stash.pending_skip is None:
                stash.pending_skip = (loss_id, scaler)


@contextlib.contextmanager
def disable_casts():
    """Run the body without O1 casts (exception safe)."""
    with _caster.disabled():
        yield


class AmpHandle:
    """The O1 handle (``amp._amp_state.handle``) and what the deprecated ``amp.init()`` returns."""

    def __init__(self, legacy: bool = False) -> None:
        self._legacy = legacy
        self._default_device = None

    def is_active(self) -> bool:
        return _caster.is_enabled()

    @contextlib.contextmanager
    def _disable_casts(self):
        with _caster.disabled():
            yield

    def _deactivate(self) -> None:
        _caster.disable()

    def _clear_cache(self) -> None:
        _caster.clear_cache()

    @property
    def has_cache(self) -> bool:
        return True

    @property
    def verbose(self) -> bool:
        return _amp_state.verbosity >= 2

    def scale_loss(self, loss, optimizer, loss_id: int = 0):
        """``amp.scale_loss``; a legacy handle registers unknown optimizers on first use."""
        if self._legacy and _amp_state.initialized and _amp_state.opt_properties.enabled:
            for opt in [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer):
                if getattr(opt, "_amp_stash", None) is None:
                    self._register(opt)
        return scale_loss(loss, optimizer, loss_id=loss_id)

    def _register(self, optimizer) -> None:
        if self._default_device is None:
            # put the scaler state next to the parameters (amp.init() saw no model)
            device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
            self._default_device = device
            old = _amp_state.loss_scalers[0]
            if device != old.device:
                _amp_state.loss_scalers[0] = LossScaler(
                    _amp_state.opt_properties.loss_scale, min_loss_scale=_amp_state.min_loss_scale,
                    max_loss_scale=_amp_state.max_loss_scale, device=device)
        process_optimizer(optimizer, _amp_state.opt_properties)

    def wrap_optimizer(self, optimizer, num_loss: int = 1):
        raise NotImplementedError(
            "amp_handle.wrap_optimizer is not supported. Use model, optimizer = amp.initialize(model, optimizer, "
            "opt_level='O1', num_losses=N) and `with amp.scale_loss(loss, optimizer, loss_id=i)`.")


class NoOpHandle:
    def is_active(self) -> bool:
        return False

    @contextlib.contextmanager
    def _disable_casts(self):
        yield

    def wrap_optimizer(self, optimizer, num_loss: int = 1):
        return optimizer

    @contextlib.contextmanager
    def scale_loss(self, loss, optimizer, loss_id: int = 0):
        yield loss

    @property
    def has_cache(self) -> bool:
        return False

    @property
    def verbose(self) -> bool:
        return False

    def _clear_cache(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass


def init(enabled=True, loss_scale="dynamic", enable_caching=True, verbose=False, allow_banned=False):
    """Deprecated pre-1.0 entry point: sets up O1 (dynamic loss scaling unless ``loss_scale`` is a number)
    and returns a handle whose ``scale_loss(loss, optimizer)`` works.  Use ``amp.initialize`` instead."""
    warnings.warn(
        "amp.init() is deprecated: replace `amp_handle = amp.init()` with "
        "`model, optimizer = amp.initialize(model, optimizer, opt_level='O1')` and "
        "`amp_handle.scale_loss(loss, optimizer)` with `amp.scale_loss(loss, optimizer)`.",
        DeprecationWarning, stacklevel=2)
    if not enabled:
        return NoOpHandle()
    properties = O1()(Properties())
    properties.loss_scale = loss_scale
    properties.low_precision_dtype = torch.float16
    _caster.disable()  # what initialize does first, too
    _amp_state.reset()
    _amp_state.verbosity = 2 if verbose else 1
    _amp_state.opt_properties = properties
    _amp_state.loss_scalers = [LossScaler(properties.loss_scale)]
    _caster.enable(torch.float16, allow_banned=allow_banned)
    handle = AmpHandle(legacy=True)
    _amp_state.handle = handle
    return handle
