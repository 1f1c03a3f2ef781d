"""What ``amp.initialize`` does to optimizers: ``optimizer._amp_stash`` (an ``AmpOptimizerState``:
master weights, gradient unscaling, step skipping) and instance-level ``step``, ``zero_grad`` and
``add_param_group``. Design: docs/amp_api.md, "Master weights (O2)", "Fused optimizers under amp".
"""

from __future__ import annotations

import types
import warnings

import torch
from torch.utils.weak import WeakIdKeyDictionary

from peak import ops

from . import _caster
from ._amp_state import LOW_DTYPES, _amp_state, log_skip_step, maybe_print
from ..scaling import OverflowFlags, group_by_device_dtype, unscale_grads_

# model parameter -> its fp32 master (used by the model's load_state_dict hook to refresh masters).
master_of = WeakIdKeyDictionary()

MASTERS_KEY = "amp_master_params"


def inner_optimizer(optimizer):
    """The torch optimizer behind an optimizer wrapper, or ``optimizer`` itself.

    Wrappers that trainers and libraries put around a torch optimizer (Accelerate's
    ``AcceleratedOptimizer`` keeps it in ``.optimizer``, Apex's and peak's ``LARC`` in ``.optim``)
    share its ``param_groups`` and forward ``step``/``zero_grad``/``state_dict`` to it: amp sets up
    the inner optimizer, and the wrapper keeps working around it."""
    for _ in range(8):  # wrappers of wrappers, not a cycle
        for attr in ("optimizer", "optim"):
            inner = getattr(optimizer, attr, None) if not isinstance(optimizer, type) else None
            if (isinstance(inner, torch.optim.Optimizer) and inner is not optimizer
                    and getattr(optimizer, "param_groups", None) is inner.param_groups):
                optimizer = inner
                break
        else:
            return optimizer
    return optimizer


class AmpOptimizerState:
    def __init__(self, optimizer, master_weights: bool, o1: bool, generation: int,
                 wrapped: bool = False) -> None:
        from peak.optimizers import FusedOptimizer  # noqa: PLC0415 (it imports nothing of amp)

        self.optimizer = optimizer
        self.master_weights = master_weights
        # A peak fused optimizer with master weights, not inside a wrapper (which may read the
        # gradients before the inner step, as LARC does: they must be unscaled by then).
        self.fused = master_weights and isinstance(optimizer, FusedOptimizer) and not wrapped
        self.fused_params: list[torch.Tensor] = []
        self.fused_grad_scale: torch.Tensor | None = None  # the scale the pending grads carry
        # ...is a static 1 (known on the host): step() then neither unscales nor stores them back.
        self.fused_scale_is_one = False
        # Their global norm, when the optimizer clips (taken by the inf/NaN check's pass).
        self.fused_grad_norm: torch.Tensor | None = None
        # Gradients set aside while a pass runs after an overflow: (params, grads, their scale).
        self.fused_set_aside: tuple | None = None
        # amp.master_params gave the masters fp32 gradients, which the step reads instead.
        self.fused_master_grads = False
        self.o1 = o1
        self.warned_no_master_grads = False
        self.generation = generation
        self.lazy_init_called = True  # Apex name; peak builds the masters eagerly
        self.params_have_scaled_gradients = False
        self.pending_skip = None  # (loss_id, scaler) of an overflow: the next step() is a no-op
        self.step_count = 0  # step() calls since initialize, skipped ones included (log line)
        # Master weights: parallel lists of low-precision model params and their fp32 masters.
        self.model_low_params: list[torch.Tensor] = []
        self.masters: list[torch.Tensor] = []
        # Params that are their own masters (fp32 params; every param without master weights).
        self.own_master_params: list[torch.Tensor] = []
        self.grad_stash: list | None = None
        self.loaded_masters = None  # masters read from a checkpoint, applied after load_state_dict
        self.copy_flags = OverflowFlags()  # throwaway overflow flags for master->model copies
        self.orig_step = optimizer.step
        self.orig_zero_grad = optimizer.zero_grad
        self.orig_add_param_group = optimizer.add_param_group

    @property
    def already_patched(self) -> bool:  # Apex name: a skip is pending
        return self.pending_skip is not None

    # ------------------------------------------------------------------ params
    def register_params(self, params, fp32_originals=None) -> list:
        """Sort ``params`` into masters / own masters; return the list to put into the param
        group (low-precision params replaced by their new fp32 masters): the parameter's fp32 data
        from before ``initialize`` cast it when known (``fp32_originals``), else an upcast copy."""
        out = []
        if self.fused:
            for p in params:
                original = fp32_originals.pop(id(p), None) if fp32_originals else None
                # the exact fp32 weights from before the cast become the optimizer's master
                if (original is not None and p.dtype in LOW_DTYPES
                        and self.optimizer._wants_master(p)):
                    self.optimizer.state[p]["master_param"] = original
                self.fused_params.append(p)
                out.append(p)
            return out
        for p in params:
            if self.master_weights and p.requires_grad and p.dtype in LOW_DTYPES:
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
            unscale_grads_(self.masters, 1.0, self.copy_flags, outputs=self.model_low_params)

    # ------------------------------------------------------------------ fused path
    def fused_prepare_backward(self, scaler) -> None:
        """Gradients still pending from an earlier pass carry that pass's scale: bring them to the
        scale of the pass about to run, so that the backward accumulates like with like. After an
        overflow (a skip is pending) set them aside instead: they may hold the inf/NaN that was
        already charged to the earlier pass's scaler, and must not be charged to this one."""
        if self.fused_master_grads:
            raise RuntimeError(
                "amp.scale_loss: amp.master_params(optimizer) already gave this fused optimizer's "
                "fp32 master weights their gradients (for clipping) and no step() or zero_grad() "
                "has used them since. Read amp.master_params once per step, after the last "
                "scale_loss block of the step (gradient accumulation: after the last micro-batch).")
        params = [p for p in self.fused_params if p.grad is not None]
        if self.fused_grad_scale is None or not params:
            return
        if self.pending_skip is not None:
            self.fused_set_aside = (params, [p.grad for p in params], self.fused_grad_scale)
            for p in params:
                p.grad = None
        else:
            _rescale_([p.grad for p in params], scaler.scale, self.fused_grad_scale)
        self.fused_grad_scale = self.fused_grad_norm = None

    def fused_post_backward(self, scaler) -> None:
        self.fused_grad_norm = None
        with torch.no_grad():
            if self.fused_set_aside is None and self.optimizer._wants_grad_norm:
                # The optimizer clips: the global norm's pass is the inf/NaN check as well (a
                # non-finite gradient makes the norm non-finite): NOTE [Clipping inside the step].
                norm = self.optimizer._global_grad_norm()
                if norm is not None:
                    flag = scaler.found_inf_for(norm.device)
                    torch.maximum(flag, (~torch.isfinite(norm)).to(flag.dtype).reshape(flag.shape),
                                  out=flag)
                    self.fused_grad_norm = norm
            else:  # after an overflow: the new gradients alone, then the earlier ones added back
                if scaler.dynamic:  # a static scaler never reads the flag (as Apex): no pass
                    scaler.check([p.grad for p in self.fused_params if p.grad is not None])
                if self.fused_set_aside is not None:
                    self._add_back_set_aside(scaler)
        self.fused_grad_scale = scaler.scale.clone()  # taken before the scale is updated
        self.fused_scale_is_one = scaler.is_static_one()

    def _add_back_set_aside(self, scaler) -> None:
        params, olds, old_scale = self.fused_set_aside
        self.fused_set_aside = None
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
        _rescale_(only_old, scaler.scale, old_scale)

    def fused_master_params(self):
        """The fp32 weights the fused optimizer steps, with fp32 gradients to clip (see the module
        docstring): masters get the unscaled model gradients in fp32 (exact for the power-of-two
        scales loss scalers use), fp32 parameters their own gradients unscaled in place."""
        opt = self.optimizer
        if not self.fused_master_grads:
            with torch.no_grad():
                scale = self.fused_grad_scale
                lows, masters, own = [], [], []
                for p in self.fused_params:
                    if p.grad is None:
                        continue
                    # (A master kept as a remainder has no fp32 tensor: its bf16 param's
                    # gradient is unscaled in place, exactly, as an fp32 param's is.)
                    if opt._wants_master(p) and not opt._wants_remainder(p):
                        state = opt.state[p]
                        if "master_param" not in state:
                            state["master_param"] = p.detach().to(torch.float32, copy=True)
                        master = state["master_param"]
                        master.grad = torch.empty_like(master)
                        lows.append(p.grad)
                        masters.append(master.grad)
                    else:
                        own.append(p.grad)
                inv = 1.0 if scale is None else scale.reciprocal()
                unscale_grads_(lows, inv, OverflowFlags(), outputs=masters)
                if scale is not None:
                    unscale_grads_(own, inv, OverflowFlags())
            opt._masters_have_grads = True  # zero_grad() drops them
            if scale is not None:
                self.fused_grad_scale = torch.ones_like(scale)
            self.fused_grad_norm = None  # the step measures what it reads (maybe clipped)
            self.fused_master_grads = True
        for group in opt.param_groups:
            for p in group["params"]:
                master = (opt.state.get(p) or {}).get("master_param")
                yield master if master is not None else p

    def drop_master_grads(self) -> None:
        """Drop the fp32 masters' gradients (amp's masters and a fused optimizer's)."""
        for m in self.masters:
            m.grad = None
        for p in self.fused_params:
            master = (self.optimizer.state.get(p) or {}).get("master_param")
            if master is not None:
                master.grad = None
        self.fused_master_grads = False

    # ------------------------------------------------------------------ backward
    def prepare_backward(self) -> None:
        for p in self.model_low_params:
            p.grad = None
        self.grad_stash = [p.grad for p in self.own_master_params]
        for p in self.own_master_params:
            p.grad = None

    def abort_backward(self) -> None:
        """Undo ``prepare_backward`` / ``fused_prepare_backward`` (the backward pass raised):
        restore the stashed gradients, put set-aside ones back as they were."""
        if self.grad_stash is not None:
            for p, s in zip(self.own_master_params, self.grad_stash):
                p.grad = s
        for p in self.model_low_params:
            p.grad = None
        self.grad_stash = None
        if self.fused_set_aside is not None:
            params, grads, self.fused_grad_scale = self.fused_set_aside
            for p, g in zip(params, grads):
                p.grad = g
            self.fused_set_aside = None

    def post_backward(self, scaler) -> None:
        """Unscale the backward's gradients into the master gradients (own masters: in place),
        adding those of earlier backward passes of the step."""
        with torch.no_grad():
            rows = []  # (new gradient, earlier gradient or None, output)
            for p, m in zip(self.model_low_params, self.masters):
                if p.grad is not None:
                    if m.grad is None:
                        m.grad = torch.empty_like(m)
                        rows.append((p.grad, None, m.grad))
                    else:
                        rows.append((p.grad, m.grad, m.grad))
            stash = self.grad_stash or [None] * len(self.own_master_params)
            for p, s in zip(self.own_master_params, stash):
                if p.grad is None:
                    p.grad = s
                else:
                    rows.append((p.grad, s, p.grad))
            new = [r for r in rows if r[1] is None]
            acc = [r for r in rows if r[1] is not None]
            if new:
                scaler.unscale([r[0] for r in new], [r[2] for r in new])
            if acc:
                scaler.unscale_with_stashed(*([r[i] for r in acc] for i in range(3)))
        self.grad_stash = None


def _rescale_(grads, new_scale: torch.Tensor, old_scale: torch.Tensor) -> None:
    """Bring gradients that carry ``old_scale`` to ``new_scale`` (device tensors)."""
    with torch.no_grad():
        ratio = new_scale / old_scale.to(new_scale.device)
        unscale_grads_(grads, ratio, OverflowFlags(ratio.shape), float64=True)


def process_optimizer(optimizer, properties, fp32_originals=None, wrapped: bool = False) -> None:
    """``wrapped``: ``optimizer`` is the inner optimizer of a wrapper (see ``inner_optimizer``)."""
    stash = AmpOptimizerState(optimizer, bool(properties.master_weights),
                              bool(properties.patch_torch_functions), _amp_state.generation,
                              wrapped=wrapped)
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


def _step(self, closure=None):
    stash = self._amp_stash
    loss = None
    args = ()
    if closure is not None:
        if isinstance(self, torch.optim.LBFGS):  # calls its closure several times in step()
            if stash.master_weights or stash.pending_skip is not None:
                raise RuntimeError(
                    f"{type(self).__name__} evaluates its closure several times inside step(); amp "
                    "supports that only without master weights (opt_level O0, O1 or O3) and when "
                    "no step is pending a skip after a gradient overflow. Use opt_level='O1'.")
            args = (closure,)
        else:
            # As torch.optim's step does first thing: the gradients and the overflow state the
            # step reads are the closure's (run with O1 casts on, as the forward would be).
            with torch.enable_grad():
                loss = closure()
    step_index = stash.step_count
    stash.step_count += 1
    if stash.pending_skip is not None:
        loss_id, scaler = stash.pending_skip
        stash.pending_skip = None
        new_scale = scaler.loss_scale()
        maybe_print("Gradient overflow.  Skipping step, loss scaler {} reducing loss scale to {}"
                    .format(loss_id, new_scale))
        log_skip_step(step_index, loss_id, new_scale, type(self).__name__)
        stash.drop_master_grads()
        stash.fused_grad_scale = stash.fused_grad_norm = None
        return loss
    if stash.masters and not stash.warned_no_master_grads:
        _warn_if_backward_bypassed_amp(stash)
    if stash.fused:
        unit = stash.fused_scale_is_one and not stash.fused_master_grads
        grad_scale, stash.fused_grad_scale = (None if unit else stash.fused_grad_scale), None
        grad_norm, stash.fused_grad_norm = stash.fused_grad_norm, None
        result = stash.orig_step(*args, grad_scale=grad_scale, grad_norm=grad_norm)
        stash.fused_master_grads = False  # the step used and dropped them
    elif stash.o1:
        with _caster.disabled():
            result = stash.orig_step(*args)
    else:
        result = stash.orig_step(*args)
    if stash.masters:
        stash.copy_masters_to_model()
        for m in stash.masters:
            m.grad = None
    return loss if closure is not None and not args else result


def _warn_if_backward_bypassed_amp(stash) -> None:
    """O2 steps the fp32 masters, whose gradients only ``scale_loss`` fills: a plain
    ``loss.backward()`` leaves them empty and the step changes nothing (in Apex too)."""
    if (any(m.grad is not None for m in stash.masters)
            or not any(p.grad is not None for p in stash.model_low_params)):
        return
    stash.warned_no_master_grads = True
    warnings.warn(
        f"{type(stash.optimizer).__name__}.step(): the model's fp16/bf16 parameters have "
        "gradients but their fp32 master weights, which this optimizer steps under "
        "master_weights=True (O2), have none, so this step leaves those weights unchanged. The "
        "backward pass ran outside amp: run it as `with amp.scale_loss(loss, optimizer) as "
        "scaled_loss: scaled_loss.backward()`.",
        UserWarning, stacklevel=3)


def _zero_grad(self, set_to_none: bool = True):
    stash = self._amp_stash
    stash.orig_zero_grad(set_to_none)
    for p in stash.model_low_params:
        if p.grad is not None and set_to_none:
            p.grad = None
        elif p.grad is not None:
            p.grad.detach_().zero_()
    stash.grad_stash = stash.fused_grad_scale = stash.fused_grad_norm = stash.fused_set_aside = None
    stash.params_have_scaled_gradients = False
    if stash.fused:
        stash.drop_master_grads()


def _add_param_group(self, param_group):
    stash = self._amp_stash
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
    params = param_group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, but "
                        "the ordering of tensors in sets will change between runs. Please use a "
                        "list instead.")
    else:
        params = list(params)
    held = {id(p) for p in stash.model_low_params + stash.fused_params}
    if any(id(p) in held for p in params):
        raise ValueError("some parameters appear in more than one parameter group (this "
                         "optimizer already steps them through their fp32 master weights)")
    n_masters, n_own = len(stash.masters), len(stash.own_master_params)
    n_fused = len(stash.fused_params)
    group = dict(param_group)
    group["params"] = stash.register_params(params)
    try:
        stash.orig_add_param_group(group)
    except BaseException:  # leave nothing half-registered
        for p in stash.model_low_params[n_masters:]:
            master_of.pop(p, None)
        del stash.model_low_params[n_masters:], stash.masters[n_masters:]
        del stash.own_master_params[n_own:], stash.fused_params[n_fused:]
        raise


# ---- checkpoints
def _flat_params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def _save_masters_hook(optimizer, state_dict):
    """Add the fp32 masters, keyed by the same indices as ``state_dict["state"]``."""
    masters = {id(m) for m in optimizer._amp_stash.masters}
    state_dict[MASTERS_KEY] = {i: p for i, p in enumerate(_flat_params(optimizer))
                               if id(p) in masters}
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
                    f"optimizer.load_state_dict: the checkpoint has an fp32 master weight for "
                    f"parameter {i} that this optimizer does not have a master for (shape or dtype "
                    "differ). Restore with the same model, opt_level and keep_batchnorm_fp32 that "
                    "wrote the checkpoint.")
            target.copy_(value)
    stash.copy_masters_to_model()
