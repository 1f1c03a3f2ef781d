"""What ``amp.initialize`` does to optimizers: master weights, gradient unscaling, step skipping.

Every optimizer gets ``optimizer._amp_stash`` (an ``AmpOptimizerState``) and instance-level ``step``,
``zero_grad`` and ``add_param_group`` methods.

Master weights (``master_weights=True``, O2's default).  For every low-precision (fp16/bf16) parameter
the optimizer holds, an fp32 master copy replaces it inside ``param_groups`` (Apex's design), so any
torch optimizer steps fp32 weights with fp32 state; after the step the model weights are refreshed from
the masters with one ``multi_tensor_scale_`` (scale 1.0) per (device, dtype).  fp32 parameters (e.g.
batch norm kept in fp32) are their own masters.  ``optimizer.state_dict()`` additionally saves the
masters under ``"amp_master_params"`` and ``optimizer.load_state_dict()`` restores them bit for bit
(optimizer state-dict hooks; see docs/amp_api.md).

Gradients.  On ``scale_loss`` entry (``prepare_backward``) existing gradients are stashed so that the
backward pass writes fresh, scaled ones; on exit (``post_backward``) the fresh ones are unscaled into the
master gradients (``multi_tensor_scale_``, fp16/bf16 in, fp32 out) or added to the stashed ones
(``multi_tensor_axpby_``, only the new gradients checked for inf/NaN).  The overflow flag stays on the
device; ``scale_loss`` reads it once to decide whether the next ``step()`` is skipped.

Fused optimizers (``peak.optimizers``; NOTE: [Fused master-weight step] in csrc/core). Under master
weights they keep the fp32 masters in their own state and read the low-precision gradients
directly, so amp neither swaps masters into ``param_groups`` nor unscales: on ``scale_loss`` exit one
read-only pass checks the gradients for inf/NaN, the scale used is kept on the device, and
``step()`` hands it to the optimizer (``grad_scale``), which unscales inside its single pass and
writes the model weights itself. Gradient accumulation over several ``scale_loss`` passes keeps the
gradients scaled by the latest scale (earlier gradients are rescaled by the ratio of two powers of
two, exact short of overflow); ``amp.master_params`` unscales them in place first, for clipping.
"""

from __future__ import annotations

import types

import torch
from torch.utils.weak import WeakIdKeyDictionary

from peak import ops

from . import _caster
from ._amp_state import log_skip_step, maybe_print
from .loss_scaler import group_by_device_dtype

_LOW = (torch.float16, torch.bfloat16)

# model parameter -> its fp32 master (used by the model's load_state_dict hook to refresh masters).
master_of = WeakIdKeyDictionary()

MASTERS_KEY = "amp_master_params"


def _is_fused(optimizer) -> bool:
    from peak.optimizers import FusedOptimizer  # noqa: PLC0415 (peak.optimizers imports nothing of amp)
    return isinstance(optimizer, FusedOptimizer)


class AmpOptimizerState:
    def __init__(self, optimizer, master_weights: bool, o1: bool, generation: int) -> None:
        self.optimizer = optimizer
        self.master_weights = master_weights
        # A peak fused optimizer with master weights: see "Fused optimizers" above.
        self.fused = master_weights and _is_fused(optimizer)
        self.fused_params: list[torch.Tensor] = []
        self.fused_grad_scale: torch.Tensor | None = None  # the scale the pending grads carry
        # Their global norm, when the optimizer clips (taken by the inf/NaN check's pass).
        self.fused_grad_norm: torch.Tensor | None = None
        self.o1 = o1
        self.generation = generation
        self.lazy_init_called = True  # Apex name; peak builds the masters eagerly
        self.params_have_scaled_gradients = False
        self.pending_skip = None  # (loss_id, scaler) of the overflow that makes the next step() a no-op
        self.step_count = 0  # step() calls since initialize, skipped ones included (for the log line)
        # Master weights: parallel lists of low-precision model params and their fp32 masters.
        self.model_low_params: list[torch.Tensor] = []
        self.masters: list[torch.Tensor] = []
        # Params that are their own masters (fp32 params; every param without master weights).
        self.own_master_params: list[torch.Tensor] = []
        self.grad_stash: list | None = None
        self.loaded_masters = None  # masters read from a checkpoint, applied after load_state_dict
        self.copy_flags: dict = {}  # per-device throwaway overflow flags for master->model copies
        self.orig_step = optimizer.step
        self.orig_zero_grad = optimizer.zero_grad
        self.orig_add_param_group = optimizer.add_param_group

    @property
    def already_patched(self) -> bool:  # Apex name: a skip is pending
        return self.pending_skip is not None

    # ------------------------------------------------------------------ params
    def register_params(self, params, fp32_originals=None) -> list:
        """Sort ``params`` into masters / own masters; return the list to put into the param group
        (low-precision params replaced by their new fp32 masters).  A master is the parameter's fp32
        data from before ``initialize`` cast it when known (``fp32_originals``), else an upcast copy."""
        out = []
        if self.fused:
            for p in params:
                original = fp32_originals.pop(id(p), None) if fp32_originals else None
                if original is not None and p.dtype in _LOW:
                    # the exact fp32 weights from before the cast become the optimizer's master
                    self.optimizer.state[p]["master_param"] = original
                self.fused_params.append(p)
                out.append(p)
            return out
        for p in params:
            if self.master_weights and p.requires_grad and p.dtype in _LOW:
                original = fp32_originals.pop(id(p), None) if fp32_originals else None
                data = original if original is not None else p.detach().to(torch.float32, copy=True)
                master = torch.nn.Parameter(data, requires_grad=True)
                self.model_low_params.append(p)
                self.masters.append(master)
                master_of[p] = master
                out.append(master)
            else:
                if p.requires_grad or not self.master_weights:
                    self.own_master_params.append(p)
                out.append(p)
        return out

    def copy_masters_to_model(self) -> None:
        with torch.no_grad():
            for device, (masters, models) in group_by_device_dtype(self.masters, self.model_low_params):
                flag = self.copy_flags.get(device)
                if flag is None:
                    flag = self.copy_flags[device] = torch.zeros(1, dtype=torch.float32, device=device)
                ops.multi_tensor_scale_(masters, models, 1.0, flag)

    # ------------------------------------------------------------------ fused path
    def fused_grads(self):
        return [p.grad for p in self.fused_params if p.grad is not None]

    def fused_prepare_backward(self, scaler) -> None:
        """Gradients still pending from an earlier pass carry that pass's scale: bring them to the
        scale of the pass about to run, so that the backward accumulates like with like."""
        grads = self.fused_grads()
        if self.fused_grad_scale is None or not grads:
            return
        with torch.no_grad():
            for device, (group,) in group_by_device_dtype(grads):
                ratio = (scaler.scale.to(device) / self.fused_grad_scale.to(device)).reshape(())
                torch._foreach_mul_(group, ratio)
        self.fused_grad_scale = None
        self.fused_grad_norm = None

    def fused_post_backward(self, scaler) -> None:
        self.fused_grad_norm = None
        with torch.no_grad():
            if self.optimizer._wants_grad_norm:
                # The optimizer clips: the global norm's pass is the inf/NaN check as well (a
                # non-finite gradient makes the norm non-finite): NOTE [Clipping inside the step].
                norm = self.optimizer._global_grad_norm()
                if norm is not None:
                    flag = scaler.found_inf_for(norm.device)
                    torch.maximum(flag, (~torch.isfinite(norm)).to(flag.dtype).reshape(flag.shape),
                                  out=flag)
                    self.fused_grad_norm = norm
            else:
                for device, (group,) in group_by_device_dtype(self.fused_grads()):
                    ops.multi_tensor_check_finite_(group, scaler.found_inf_for(device))
        self.fused_grad_scale = scaler.scale.clone()  # taken before the scale is updated

    def fused_unscale_in_place(self) -> None:
        """Unscale the pending gradients in place (for clipping); the step then divides by 1."""
        if self.fused_grad_scale is None:
            return
        with torch.no_grad():
            for device, (group,) in group_by_device_dtype(self.fused_grads()):
                inv = self.fused_grad_scale.to(device).reciprocal()
                ops.multi_tensor_scale_(group, group, inv, torch.zeros(1, device=device))
        self.fused_grad_scale = torch.ones_like(self.fused_grad_scale)
        self.fused_grad_norm = None  # the step measures the unscaled (maybe clipped) gradients

    # ------------------------------------------------------------------ backward
    def prepare_backward(self) -> None:
        for p in self.model_low_params:
            p.grad = None
        self.grad_stash = [p.grad for p in self.own_master_params]
        for p in self.own_master_params:
            p.grad = None

    def abort_backward(self) -> None:
        """Undo ``prepare_backward`` (the backward pass raised): restore the stashed gradients."""
        if self.grad_stash is not None:
            for p, s in zip(self.own_master_params, self.grad_stash):
                p.grad = s
        for p in self.model_low_params:
            p.grad = None
        self.grad_stash = None

    def post_backward(self, scaler) -> None:
        with torch.no_grad():
            if self.model_low_params:
                new_in, new_out, acc_in, acc_out = [], [], [], []
                for p, m in zip(self.model_low_params, self.masters):
                    if p.grad is None:
                        continue
                    if m.grad is None:
                        m.grad = torch.empty_like(m)
                        new_in.append(p.grad)
                        new_out.append(m.grad)
                    else:
                        acc_in.append(p.grad)
                        acc_out.append(m.grad)
                if new_in:
                    scaler.unscale(new_in, new_out)
                if acc_in:
                    scaler.unscale_with_stashed(acc_in, acc_out, acc_out)

            stash = self.grad_stash or [None] * len(self.own_master_params)
            new, acc, acc_stash = [], [], []
            for p, s in zip(self.own_master_params, stash):
                if p.grad is None:
                    if s is not None:
                        p.grad = s
                elif s is None:
                    new.append(p.grad)
                else:
                    acc.append(p.grad)
                    acc_stash.append(s)
            if new:
                scaler.unscale(new, new)
            if acc:
                scaler.unscale_with_stashed(acc, acc_stash, acc)
            self.grad_stash = None


def process_optimizer(optimizer, properties, fp32_originals=None) -> None:
    from ._amp_state import _amp_state  # noqa: PLC0415

    stash = AmpOptimizerState(optimizer, bool(properties.master_weights),
                              bool(properties.patch_torch_functions), _amp_state.generation)
    had_state = len(optimizer.state) > 0
    for group in optimizer.param_groups:
        old = list(group["params"])
        group["params"] = stash.register_params(old, fp32_originals)
        for p, q in zip(old, group["params"]):
            if p is not q and p in optimizer.state:
                optimizer.state[q] = optimizer.state.pop(p)
    if had_state:
        # Cast existing per-parameter state to the (new) parameter dtypes, as Apex does.
        optimizer.load_state_dict(optimizer.state_dict())

    optimizer._amp_stash = stash
    optimizer.step = types.MethodType(_step, optimizer)
    optimizer.zero_grad = types.MethodType(_zero_grad, optimizer)
    optimizer.add_param_group = types.MethodType(_add_param_group, optimizer)
    if stash.master_weights and not stash.fused:  # a fused optimizer saves its masters itself
        optimizer.register_state_dict_post_hook(_save_masters_hook)
        optimizer.register_load_state_dict_pre_hook(_take_masters_hook)
        optimizer.register_load_state_dict_post_hook(_restore_masters_hook)


_CLOSURE_MSG = ("Currently, Amp does not support closure use with optimizers{}: compute the loss, run "
                "`with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()`, then call "
                "optimizer.step() without a closure.")


def _step(self, closure=None):
    stash = self._amp_stash
    step_index = stash.step_count
    stash.step_count += 1
    if stash.pending_skip is not None:
        loss_id, scaler = stash.pending_skip
        stash.pending_skip = None
        if closure is not None:
            raise RuntimeError(_CLOSURE_MSG.format(" on a step skipped after a gradient overflow"))
        new_scale = scaler.loss_scale()
        maybe_print("Gradient overflow.  Skipping step, loss scaler {} reducing loss scale to {}".format(
            loss_id, new_scale))
        log_skip_step(step_index, loss_id, new_scale, type(self).__name__)
        for m in stash.masters:
            m.grad = None
        return None
    if closure is not None and stash.master_weights and not stash.fused:
        raise RuntimeError(_CLOSURE_MSG.format(" and master weights"))
    args = () if closure is None else (closure,)
    if stash.fused:
        grad_scale, stash.fused_grad_scale = stash.fused_grad_scale, None
        grad_norm, stash.fused_grad_norm = stash.fused_grad_norm, None
        result = stash.orig_step(*args, grad_scale=grad_scale, grad_norm=grad_norm)
    elif stash.o1:
        with _caster.disabled():
            result = stash.orig_step(*args)
    else:
        result = stash.orig_step(*args)
    if stash.masters:
        stash.copy_masters_to_model()
        for m in stash.masters:
            m.grad = None
    return result


def _zero_grad(self, set_to_none: bool = True):
    stash = self._amp_stash
    stash.orig_zero_grad(set_to_none)
    for p in stash.model_low_params:
        if p.grad is not None:
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()
    stash.grad_stash = None
    stash.params_have_scaled_gradients = False
    stash.fused_grad_scale = None
    stash.fused_grad_norm = None


def _add_param_group(self, param_group):
    stash = self._amp_stash
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering of "
                        "tensors in sets will change between runs. Please use a list instead.")
    else:
        params = list(params)
    held = {id(p) for p in stash.model_low_params + stash.fused_params}
    if any(id(p) in held for p in params):
        raise ValueError("some parameters appear in more than one parameter group (this optimizer already "
                         "steps them through their fp32 master weights)")
    n_masters, n_own, n_fused = len(stash.masters), len(stash.own_master_params), len(stash.fused_params)
    group = dict(param_group)
    group["params"] = stash.register_params(params)
    try:
        stash.orig_add_param_group(group)
    except BaseException:
        # leave nothing half-registered
        for p in stash.model_low_params[n_masters:]:
            master_of.pop(p, None)
        del stash.model_low_params[n_masters:], stash.masters[n_masters:], stash.own_master_params[n_own:]
        del stash.fused_params[n_fused:]
        raise


# ---------------------------------------------------------------------------------------------- checkpoints
def _flat_params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def _save_masters_hook(optimizer, state_dict):
    """Add the fp32 masters, keyed by the same indices as ``state_dict["state"]``."""
    masters = {id(m) for m in optimizer._amp_stash.masters}
    state_dict[MASTERS_KEY] = {i: p for i, p in enumerate(_flat_params(optimizer)) if id(p) in masters}
    return state_dict


def _take_masters_hook(optimizer, state_dict):
    optimizer._amp_stash.loaded_masters = state_dict.pop(MASTERS_KEY, None)
    return state_dict


def _restore_masters_hook(optimizer):
    stash = optimizer._amp_stash
    loaded, stash.loaded_masters = stash.loaded_masters, None
    if loaded is None:
        return  # a checkpoint without masters: keep the masters derived from the model
    flat = _flat_params(optimizer)
    masters = {id(m) for m in stash.masters}
    with torch.no_grad():
        for i, value in loaded.items():
            target = flat[i] if 0 <= i < len(flat) else None
            if target is None or id(target) not in masters or target.shape != value.shape:
                raise RuntimeError(
                    f"optimizer.load_state_dict: the checkpoint has an fp32 master weight for parameter {i} "
                    "that this optimizer does not have a master for (shape or dtype differ). Restore with the "
                    "same model, opt_level and keep_batchnorm_fp32 that wrote the checkpoint.")
            target.copy_(value)
    stash.copy_masters_to_model()
