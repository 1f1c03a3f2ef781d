"""What ``amp.initialize`` does to optimizers: ``optimizer._amp_stash`` (one of two kinds) and
instance-level ``step``, ``zero_grad`` and ``add_param_group``; the skip on overflow, on the
device or the host (docs/amp_api.md, "Master weights (O2)" and "Fused optimizers under amp")."""

from __future__ import annotations

import contextlib
import logging

import torch

from peak import ops
from peak.optimizers.masters import (LOW_DTYPES, ApexStashLists, MasterWeights, drop_left_grads,
                                    grad_versions, grads_left, own_grad, register_owner,
                                    stepped_elsewhere, warn_bare_masters, warn_bypassed_masters,
                                    warn_changed_grads)

from . import _caster
from ._amp_state import _amp_state, log_skip_step, logger, maybe_print
from .._bound import BoundMethod, stands_in_for
from ..scaling import OverflowFlags, group_by_device_dtype, skip_leaves_state_unset, unscale_grads_


class AmpOptimizerState(ApexStashLists):
    """What both kinds share: the step's skip (on the device or the host), its log line."""

    consumes_scaled_grads = False
    grad_holders = property(lambda self: self.params)  # (what a backward gives gradients)

    def __init__(self, optimizer, master_weights: bool, o1: bool, generation: int) -> None:
        self.optimizer, self.master_weights, self.o1 = optimizer, master_weights, o1
        self.generation = generation
        self.lazy_init_called = True  # Apex name; peak builds the masters eagerly
        self.params_have_scaled_gradients = False
        self.delayed_scale = None  # (scaler, its update count, scale): a delayed exit's gradients
        # The step takes found_inf and skips on the device (torch's protocol attribute).
        self.device_skip = (bool(getattr(optimizer, "_step_supports_amp_scaling", False))
                            and not isinstance(optimizer, torch.optim.LBFGS))
        self.sharded = any(getattr(p, "device_mesh", None) is not None  # FSDP2's DTensors
                           for group in optimizer.param_groups for p in group["params"])
        self.found_inf, self.left = None, []  # the next step()'s flag; the last step's grads
        self.pending_skip = None  # host skip: (loss_id, scaler) of an overflow
        self.in_flight: list = []  # device skip: (step, loss_id, host [flag, new scale], event)
        self.first_skip: dict = {}  # step -> [loss_id, scale] of its first overflow, or None
        self.step_count = 0  # step() calls since initialize, skipped ones included (log line)
        self.warned_no_master_grads = self.warned_no_grads = False
        self.orig_step, self.orig_zero_grad, self.orig_add_param_group = (
            optimizer.step, optimizer.zero_grad, optimizer.add_param_group)

    in_wrapper_step = False  # (its skip's flag is kept: NOTE: [A wrapper's work after the step])
    # Apex's "a skip is pending" (a host read when asked).
    already_patched = property(lambda self: self.pending_skip is not None or (
        self.found_inf is not None and bool(self.found_inf.any())))

    def skips_on_device(self) -> bool:
        return self.device_skip and not skip_leaves_state_unset(self.optimizer)

    def note_overflow(self, loss_id: int, scaler) -> None:
        """A ``scale_loss`` exit of a dynamic scaler (device skip): keep its flag for step(), and
        start a copy of [flag, new scale] to the host for the message (no wait)."""
        device = next((p.device for g in self.optimizer.param_groups for p in g["params"]),
                      torch.device("cpu"))
        flag = scaler.found_inf_on(device)
        self.found_inf = flag if self.found_inf is None else torch.maximum(self.found_inf, flag)
        if _amp_state.verbosity > 0 or logger.isEnabledFor(logging.INFO):
            report, event = torch.cat([flag, scaler.scale.to(device)]), None
            if device.type == "cuda":
                report = torch.empty(2, pin_memory=True).copy_(report, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            self.in_flight.append((self.step_count, loss_id, report, event))

    def print_reports(self) -> None:  # one line per skipped step once its reports all arrived
        while self.in_flight and (self.in_flight[0][3] is None or self.in_flight[0][3].query()):
            step_index, loss_id, host, _ = self.in_flight.pop(0)
            skipped, new_scale = host.tolist()  # (as Apex: the first overflowing loss, with its
            first = self.first_skip.get(step_index)  # scale after the step's last exit)
            if first is None and skipped:
                self.first_skip[step_index] = [loss_id, new_scale]
            elif first is not None and first[0] == loss_id:
                first[1] = new_scale
            if step_index in self.first_skip and all(e[0] != step_index for e in self.in_flight):
                self.print_skip(step_index, *self.first_skip.pop(step_index))

    def print_skip(self, step_index: int, loss_id: int, new_scale: float) -> None:
        maybe_print("Gradient overflow.  Skipping step, loss scaler {} reducing loss scale to {}"
                    .format(loss_id, new_scale))
        log_skip_step(step_index, loss_id, new_scale, type(self.optimizer).__name__)

    def follow_scaler(self, scaler) -> None:
        """Gradients a delayed exit left with another scale (another loss's, or this scaler's
        before an update) take ``scaler``'s (docs/advanced.md, "Gradient accumulation")."""
        if self.delayed_scale and self.delayed_scale[:2] != (scaler, scaler.update_count):
            ratio = (scaler.scale / self.delayed_scale[2].to(scaler.scale.device)).reshape(())
            for p in (p for p in self.grad_holders if p.grad is not None):
                ratio = ratio.to(p.grad.device)  # (sparse: two may share values, so a copy)
                p.grad = p.grad * ratio if p.grad.is_sparse else p.grad.mul_(ratio)
            self.delayed_scale = (scaler, scaler.update_count, scaler.scale.clone())

    def master_params(self):
        yield from (p for group in self.optimizer.param_groups for p in group["params"])

    def before_step(self) -> None:
        """Checks of the step about to run."""

    def zero_grad(self, set_to_none: bool) -> None:
        """After the optimizer's own ``zero_grad``: what amp keeps for the step is dropped."""
        self.params_have_scaled_gradients, self.delayed_scale, self.left = False, None, []


class ScaledGradsState(AmpOptimizerState):
    """A peak fused optimizer that owns its masters and reads the scaled gradients."""

    consumes_scaled_grads = True
    accumulating = property(lambda self: self.set_aside is not None)  # (this step's, set aside)

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.params: list[torch.Tensor] = []
        # The pending grads' scale (static 1: step() neither unscales nor stores them), their norm
        # when the optimizer clips, grads set aside while a later pass runs ((params, grads,
        # scale)), the scaled grads handed over (grad_versions), whether the masters got fp32 grads
        # and were read without (a list then taken has none later; None: the step said so once).
        self.grad_scale = self.grad_norm = self.set_aside = self.handed = None
        self.scale_is_one = self.master_grads_given = self.read_bare = False

    def register_params(self, params, fp32_originals=None) -> list:
        """The params stay in the group; their fp32 weights from before the cast are the masters."""
        for p in params:
            original = fp32_originals.pop(id(p), None) if fp32_originals else None
            if original is not None and p.dtype in LOW_DTYPES and p.requires_grad:
                self.optimizer.set_master(p, original)  # (a frozen one's: when first stepped)
            register_owner(p, self.optimizer)  # (the model's load hook refreshes its master)
            self.params.append(p)
        return list(params)

    # (As the store's: holds(p); mark() before registering a group, rollback(mark) if refused.)
    holds = property(lambda self: lambda p: any(q is p for q in self.params))
    mark = property(lambda self: self.params.__len__)
    rollback = property(lambda self: lambda mark: self.params.__delitem__(slice(mark, None)))

    def zero_grad(self, set_to_none: bool) -> None:
        super().zero_grad(set_to_none)
        self.drop_pending()  # (the optimizer's zero_grad dropped the masters' gradients)

    def prepare_backward(self, scaler) -> None:
        """Set aside the gradients an earlier pass left (they carry its scale and may hold an
        inf/NaN charged to its scaler); exit checks the new ones alone, then adds them back."""
        if self.master_grads_given and (self.grad_scale is None or all(  # given from no exit's,
                m.grad is None for m in self.optimizer.master_params())):  # or the script dropped
            self.drop_pending()  # them (NVIDIA's BERT after a skip it decided): the scaled ones
            self.left = grads_left(self.params)  # they were taken from go too, as in Apex
        elif self.master_grads_given:
            raise RuntimeError(
                "amp.scale_loss: amp.master_params(optimizer) already gave this fused optimizer's "
                "fp32 master weights their gradients (for clipping) and no step() or zero_grad() "
                "has used them since. Read amp.master_params once per step, after the last "
                "scale_loss block of the step (gradient accumulation: after the last micro-batch).")
        drop_left_grads(self.left)  # (a skipped step's inf would be charged again)
        params = [p for p in self.params if p.grad is not None]
        if self.grad_scale is None or not params:
            return
        self.set_aside = (params, [own_grad(p.grad) for p in params], self.grad_scale)
        for p in params:
            p.grad = None
        self.grad_scale = self.grad_norm = None

    def abort_backward(self) -> None:
        if self.set_aside is not None:
            params, grads, self.grad_scale = self.set_aside
            for p, g in zip(params, grads):
                p.grad = g
            self.set_aside = None

    def post_backward(self, scaler) -> bool:
        self.grad_norm = None
        got_grads = any(p.grad is not None for p in self.params)
        with torch.no_grad():
            if self.set_aside is None and self.optimizer.clips_by_norm:
                # The global norm's pass is the inf/NaN check too: NOTE [Clipping inside the step].
                norm = self.optimizer.grad_norm()
                if norm is not None:
                    flag = scaler.found_inf_for(norm.device)
                    torch.maximum(flag, (~torch.isfinite(norm)).to(flag.dtype).reshape(flag.shape),
                                  out=flag)
                    self.grad_norm = norm
            else:  # the new gradients alone, then the earlier ones added back
                if scaler.dynamic:  # a static scaler never reads the flag (as Apex): no pass
                    scaler.check([p.grad._values() if p.grad.is_sparse else p.grad  # (refused
                                  for p in self.params if p.grad is not None])  # by the step)
                if self.set_aside is not None:
                    self._add_back_set_aside(scaler)
        self.grad_scale = scaler.scale.clone()  # taken before the scale is updated
        self.scale_is_one = scaler.is_static_one()
        self.handed = None if self.scale_is_one else grad_versions(self.params)
        return got_grads

    def _add_back_set_aside(self, scaler) -> None:
        params, olds, old_scale = self.set_aside
        self.set_aside = None
        both_new, both_old, only_old = [], [], []
        for p, old in zip(params, olds):
            if p.grad is None:
                p.grad = old
                only_old.append(old)
            else:
                both_new.append(p.grad)
                both_old.append(old)
        for device, _, _, (news, olds_) in group_by_device_dtype(both_new, both_old):
            ratio = (scaler.scale.to(device) / old_scale.to(device)).reshape(1)
            ops.multi_tensor_axpby_(news, olds_, news, 1.0, ratio, ops.new_found_inf(device),
                                    check="none")
        ratio = scaler.scale / old_scale.to(scaler.scale.device)
        unscale_grads_(only_old, ratio, OverflowFlags(ratio.shape), float64=True)
        # Sums may overflow where neither part did: charged to this pass's scaler, unless the
        # earlier gradients held the inf themselves (already charged, to their own pass).
        if not scaler.dynamic or self.pending_skip is not None:
            return
        sums = OverflowFlags()
        unscale_grads_(both_new + only_old, 1.0, sums, check_only=True)
        for device, flag in sums.items():
            charged = scaler.found_inf_for(device)
            if self.found_inf is not None:
                flag = flag * (1 - self.found_inf.to(device).reshape(flag.shape))
            torch.maximum(charged, flag.reshape(charged.shape), out=charged)

    def master_params(self):
        """The fp32 weights stepped, given fp32 gradients to clip (which the step then reads);
        without gradients (before a backward, after zero_grad: an EMA or a log) just the weights."""
        with_grads = any(p.grad is not None for p in self.params)
        self.read_bare = None if self.read_bare is None else self.read_bare or not with_grads
        if with_grads and not self.master_grads_given:
            warn_changed_grads(self.handed, type(self.optimizer).__name__)
            self.optimizer.give_master_grads(self.grad_scale)
            self.grad_scale = None if self.grad_scale is None else torch.ones_like(self.grad_scale)
            self.grad_norm = None  # the step measures what it reads (maybe clipped)
            self.master_grads_given, self.handed = True, None  # (the step reads the masters')
        yield from self.optimizer.master_params()

    def run_step(self, args, found_inf):
        kept = self.grad_scale, self.grad_norm  # (a step that raises keeps them)
        warn_changed_grads(self.handed, type(self.optimizer).__name__)
        if self.read_bare and not self.master_grads_given:
            self.read_bare = warn_bare_masters(type(self.optimizer).__name__)
        unit = self.scale_is_one and not self.master_grads_given
        grad_scale, self.grad_scale = (None if unit else self.grad_scale), None
        grad_norm, self.grad_norm = self.grad_norm, None
        try:
            result = self.orig_step(*args, grad_scale=grad_scale, found_inf=found_inf,
                                    grad_norm=grad_norm)
        except BaseException:
            self.grad_scale, self.grad_norm = kept
            raise
        self.master_grads_given, self.handed, self.read_bare = False, None, self.read_bare and False
        return result

    def drop_pending(self) -> None:
        self.optimizer.drop_master_grads()
        self.grad_scale = self.grad_norm = self.set_aside = self.handed = None
        self.master_grads_given = False


class UnscaledGradsState(AmpOptimizerState):
    """Any other optimizer: the gradients are unscaled into the fp32 masters of a ``MasterWeights``
    store (O2: the masters stand in for the fp16/bf16 params in the groups) or in place."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.store = MasterWeights()

    masters = property(lambda self: self.store.masters)  # Apex scripts' view
    in_wrapper_step = property(lambda self: self.store.held is not None)

    def register_params(self, params, fp32_originals=None) -> list:
        return self.store.register(params, self.master_weights, fp32_originals)

    # What the store does itself (peak.optimizers.masters.MasterWeights).
    holds = property(lambda self: self.store.holds)
    mark = property(lambda self: self.store.mark)
    rollback = property(lambda self: self.store.rollback)
    abort_backward = property(lambda self: self.store.restore_grads)
    post_backward = property(lambda self: self.store.take_grads)
    accumulating = property(lambda self: self.store.took_grads)  # (an exit of this step's before)
    grad_holders = property(  # (frozen ones too: unfrozen since, their first gradients)
        lambda self: self.store.model_params + self.store.own_params + self.store.frozen)

    def zero_grad(self, set_to_none: bool) -> None:
        super().zero_grad(set_to_none)
        self.store.zero_grad(set_to_none)

    def before_step(self) -> None:
        """O2 steps the fp32 masters, whose gradients only ``scale_loss`` fills: a plain
        ``loss.backward()`` leaves them empty and the step changes nothing (in Apex too)."""
        if not self.warned_no_master_grads and self.store.bypassed():
            self.warned_no_master_grads = warn_bypassed_masters(type(self.optimizer).__name__)

    def prepare_backward(self, scaler) -> None:
        drop_left_grads(self.left)
        self.store.set_grads_aside()

    def run_step(self, args, found_inf):
        opt = self.optimizer
        if found_inf is not None:  # torch's fused optimizers read it as an attribute
            opt.found_inf = found_inf.reshape(())
        self.store.follow_weights()
        completed = False
        try:
            with _caster.disabled() if self.o1 else contextlib.nullcontext():
                result = self.orig_step(*args)
            completed = True
        finally:
            if found_inf is not None:
                del opt.found_inf
            self.store.after_step(completed)  # (the model follows what a step wrote)
        return result

    def drop_pending(self) -> None:
        self.store.drop_grads()


def process_optimizer(optimizer, properties, fp32_originals=None, wrapper=None) -> None:
    """``wrapper``: the object given, around ``optimizer`` (``inner_optimizer``); it may read the
    gradients before the inner step (as LARC does): they are unscaled by then; and work after it
    (NOTE: [A wrapper's work after the step])."""
    from peak.optimizers import FusedOptimizer  # noqa: PLC0415 (it imports nothing of amp)
    master_weights, wrapped = bool(properties.master_weights), wrapper not in (None, optimizer)
    kind = (ScaledGradsState if master_weights and isinstance(optimizer, FusedOptimizer)
            and not wrapped else UnscaledGradsState)
    stash = kind(optimizer, master_weights, bool(properties.patch_torch_functions),
                 _amp_state.generation)
    had_state = len(optimizer.state) > 0
    for group in optimizer.param_groups:
        old = list(group["params"])
        group["params"] = stash.register_params(old, fp32_originals)
        for p, q in zip(old, group["params"]):
            if p is not q and p in optimizer.state:
                optimizer.state[q] = optimizer.state.pop(p)
    if had_state:  # existing per-parameter state cast to the (new) parameter dtypes, as Apex does
        optimizer.load_state_dict(optimizer.state_dict())
    optimizer._amp_stash = stash
    optimizer._lazy_init_maybe_master_weights = optimizer._amp_lazy_init = lambda: None  # (Apex's)
    optimizer.step = BoundMethod(_step, optimizer, optimizer.step)
    optimizer.zero_grad = BoundMethod(_zero_grad, optimizer)
    optimizer.add_param_group = BoundMethod(_add_param_group, optimizer)
    if kind is UnscaledGradsState and master_weights:  # a fused optimizer saves its own masters
        stash.store.attach(optimizer)
    if wrapped:  # scale_loss and master_params accept the wrapper; its step runs around amp's
        wrapper._amp_stash, stash.orig_wrapper_step = stash, wrapper.step
        wrapper._lazy_init_maybe_master_weights = wrapper._amp_lazy_init = lambda: None
        wrapper.step = BoundMethod(_wrapper_step, wrapper, wrapper.step)


@torch._disable_dynamo  # (eager, whole: a compiled step lost what it set before a graph break)
def _step(self, closure=None):
    stash = self._amp_stash
    loss, args = None, ()
    if closure is not None:
        if isinstance(self, torch.optim.LBFGS):  # calls its closure several times in step()
            if stash.master_weights or any(s.dynamic for s in _amp_state.loss_scalers):
                raise RuntimeError(  # (it cannot skip one whose gradients overflow)
                    f"{type(self).__name__} runs its closure several times inside step(): amp "
                    "takes it without master weights (O0, O1, O3) and with a static loss scale "
                    "(amp.initialize(..., loss_scale=128.0); bf16's default is static 1.0)")
            args = (_caster.resumed()(closure) if stash.o1 else closure,)  # (casts on in it)
        else:
            # As torch.optim's step does first thing: the gradients and the overflow state the
            # step reads are the closure's (run with O1 casts on, as the forward would be).
            with torch.enable_grad():
                loss = closure()
    if stash.params_have_scaled_gradients:  # (refused before anything changes)
        raise RuntimeError(
            f"{type(self).__name__}.step(): the gradients are still scaled and unchecked: the last "
            "amp.scale_loss exit had delay_unscale=True. Exit the last micro-batch's scale_loss "
            "without delay_unscale (it unscales and checks everything accumulated), then step")
    step_index, stash.step_count = stash.step_count, stash.step_count + 1
    stash.print_reports()  # earlier steps' skips whose reports have arrived
    if stash.pending_skip is not None:
        (loss_id, scaler), stash.pending_skip, stash.found_inf = stash.pending_skip, None, None
        stash.print_skip(step_index, loss_id, scaler.loss_scale())
        stash.drop_pending()
        stash.left = grads_left(stash.grad_holders) if stash.master_weights else []
        return loss
    stash.before_step()
    found_inf, stash.found_inf = stash.found_inf, stash.found_inf if stash.in_wrapper_step else None
    try:
        result = stash.run_step(args, found_inf)
    except BaseException:  # a step that raises keeps what it was handed
        stash.found_inf = found_inf
        raise
    stash.print_reports()  # at once where the report needs no copy (the CPU)
    stash.left = grads_left(stash.grad_holders) if stash.master_weights else []
    return loss if closure is not None and not args else result


@stands_in_for(lambda wrapper: wrapper._amp_stash.orig_wrapper_step)
def _wrapper_step(self, *args, **kwargs):  # NOTE: [A wrapper's work after the step]
    stash = self._amp_stash  # (a skip's flag is kept for the rest of it)
    ended = lambda: setattr(stash, "found_inf", None)  # noqa: E731
    return stash.store.around_wrapper(stash.orig_wrapper_step, ended, *args, **kwargs)


def _zero_grad(self, set_to_none: bool | None = None):  # (None: Apex's set_grad_none, or True)
    set_to_none = getattr(self, "set_grad_none", True) if set_to_none is None else set_to_none
    self._amp_stash.orig_zero_grad(set_to_none)
    self._amp_stash.zero_grad(set_to_none)


def _add_param_group(self, param_group):
    stash = self._amp_stash
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
    params = param_group["params"]
    if isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, but "
                        "the ordering of tensors in sets will change between runs. Please use a "
                        "list instead.")
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    unscales = stash.master_weights or _amp_state.opt_properties.loss_scale != 1.0
    if any(stash.holds(p) for p in params) or unscales and (len(set(map(id, params))) < len(
            params) or any(stepped_elsewhere(p) for p in params)):
        raise ValueError("some parameters appear in more than one parameter group, of this or "
                         "another optimizer (amp keeps a master or unscales per holder): add each "
                         "once")
    mark = stash.mark()
    group = dict(param_group, params=stash.register_params(params))
    try:
        stash.orig_add_param_group(group)
    except BaseException:  # leave nothing half-registered
        stash.rollback(mark)
        raise
