"""FusedSGD, FusedAdam and FusedLAMB: torch.optim-compatible optimizers whose step is one C++
kernel per (device, dtype) bucket -- unscale, skip on overflow, fp32 master and state update,
low-precision weight write -- on CPU and CUDA. See NOTE: [Fused master-weight step]."""
from __future__ import annotations

import torch

from ._base import FusedOptimizer, _check_hyper


def _check_materialize(materialize_master_grads) -> None:
    """Apex's option (its FusedSGD/FusedAdam build fp32 master gradients unless it is False).
    peak's step reads the fp16/bf16 gradients directly and never builds them, so both values
    step alike."""
    if not isinstance(materialize_master_grads, bool):
        raise ValueError(f"materialize_master_grads must be True or False, got "
                         f"{materialize_master_grads!r}")


class FusedSGD(FusedOptimizer):
    """SGD with momentum, dampening, Nesterov and weight decay, as ``torch.optim.SGD``.

    ``master_weights`` (None: automatic) keeps fp32 masters for fp16/bf16 parameters;
    ``stochastic_rounding=True`` (with ``master_weights=False``) rounds bf16 weights stepped
    directly up or down at random, in proportion (see "Stochastic rounding" in docs/core.md).
    ``max_grad_norm > 0`` clips by the global norm of all the optimizer's gradients inside the
    step, as ``torch.nn.utils.clip_grad_norm_`` would (see "Clipping inside the step").
    ``store_param_remainders``, ``momentum_dtype`` (the buffer's storage) and ``moment_rounding``
    as :class:`FusedAdam`'s lean options."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, wd_after_momentum=False, materialize_master_grads=True,
                 set_grad_none=True, *, maximize=False, master_weights=None,
                 stochastic_rounding=False, max_grad_norm=0.0, capturable=False,
                 store_unscaled_grads=True, store_param_remainders=False,
                 momentum_dtype=torch.float32, moment_rounding="stochastic"):
        # Apex's FusedSGD arguments, in Apex's positions; its two variants are not provided.
        if wd_after_momentum:
            raise NotImplementedError(
                "FusedSGD(wd_after_momentum=True) (Apex's variant that adds weight decay after "
                "the momentum update) is not provided: peak's FusedSGD is torch.optim.SGD's "
                "algorithm (weight decay added to the gradient before momentum). Leave "
                "wd_after_momentum=False")
        _check_materialize(materialize_master_grads)
        _check_hyper("learning rate", lr, lo=0.0)
        _check_hyper("momentum value", momentum, lo=0.0)
        _check_hyper("weight_decay value", weight_decay, lo=0.0)
        _check_hyper("max_grad_norm", max_grad_norm, lo=0.0)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, max_grad_norm=float(max_grad_norm))
        lean = dict(store_param_remainders=store_param_remainders, momentum_dtype=momentum_dtype,
                    moment_rounding=moment_rounding)
        super().__init__(params, defaults, master_weights, stochastic_rounding, set_grad_none,
                         store_unscaled_grads, capturable, lean=lean)

    def _state_keys_for(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _state_started(self, state, key):
        # Momentum switched on mid-run (a warm-up from 0): torch.optim.SGD seeds a missing
        # buffer with the gradient; the kernel seeds on a parameter's first step, so count from
        # there again (FusedSGD's step count serves only that, and stochastic rounding's bits).
        if key == "momentum_buffer":
            state["step"].zero_()

    def _launch(self, group, params, grads, masters, states, lr, grad_scale, found_inf):
        buffers = [s["momentum_buffer"] for s in states] if group["momentum"] != 0 else []
        torch.ops.peak.fused_sgd_(params, grads, masters, buffers, [s["step"] for s in states], lr,
                                  group["momentum"], group["dampening"], group["weight_decay"],
                                  group["nesterov"], group["maximize"], grad_scale, found_inf,
                                  stochastic_rounding_seed=self._rounding_seed(group, params),
                                  store_unscaled_grads=self._step_store_grads,
                                  **self._moment_args(group, states),
                                  **self._clip_args(group, lr.device))

    def _complete_loaded_state(self, p, state):
        had_step = "step" in state
        super()._complete_loaded_state(p, state)
        if not had_step and "momentum_buffer" in state:
            state["step"].fill_(1.0)  # a torch.optim.SGD buffer: momentum is already seeded


class FusedAdam(FusedOptimizer):
    """Adam, or AdamW with ``adam_w_mode=True`` (decoupled weight decay), as ``torch.optim.Adam``
    / ``AdamW``; ``amsgrad``, ``bias_correction`` and ``set_grad_none`` as Apex's FusedAdam.
    The arguments are in torch.optim.Adam's order and ``adam_w_mode`` defaults to False (torch's
    Adam); Apex's FusedAdam defaults to AdamW: pass ``adam_w_mode=True`` for Apex's behaviour.
    ``master_weights``, ``stochastic_rounding`` and ``max_grad_norm`` as for :class:`FusedSGD`.

    Lean state (see "Lean optimizer state" in docs/core.md): ``store_param_remainders=True``
    keeps the master of each bf16 parameter as the 16 low bits its bf16 weight drops (exact fp32
    masters in 2 bytes; the weight is the master rounded to nearest with ties away from zero);
    ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` (``torch.float32`` or ``torch.bfloat16``) choose the
    moments' storage, rounded stochastically (``moment_rounding="stochastic"``, the default) or
    to nearest even (``"nearest"``). All of them with a bf16 model: 10 bytes per parameter for
    weights, gradients and optimizer state, against 16 for fp32 state."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, adam_w_mode=False, bias_correction=True, maximize=False,
                 master_weights=None, stochastic_rounding=False, max_grad_norm=0.0,
                 set_grad_none=True, capturable=False, materialize_master_grads=True,
                 store_unscaled_grads=True, store_param_remainders=False,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 moment_rounding="stochastic"):
        _check_hyper("learning rate", lr, lo=0.0)
        _check_hyper("epsilon value", eps, lo=0.0)
        _check_hyper("beta parameter at index 0", betas[0], lo=0.0, hi=1.0, hi_open=True)
        _check_hyper("beta parameter at index 1", betas[1], lo=0.0, hi=1.0, hi_open=True)
        _check_hyper("weight_decay value", weight_decay, lo=0.0)
        _check_hyper("max_grad_norm", max_grad_norm, lo=0.0)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, adam_w_mode=adam_w_mode,
                        bias_correction=bias_correction, maximize=maximize,
                        max_grad_norm=float(max_grad_norm))
        _check_materialize(materialize_master_grads)
        if amsgrad and (exp_avg_dtype != torch.float32 or exp_avg_sq_dtype != torch.float32):
            raise ValueError("amsgrad=True keeps fp32 moments: leave exp_avg_dtype and "
                             "exp_avg_sq_dtype at torch.float32, or set amsgrad=False")
        lean = dict(store_param_remainders=store_param_remainders, exp_avg_dtype=exp_avg_dtype,
                    exp_avg_sq_dtype=exp_avg_sq_dtype, moment_rounding=moment_rounding)
        super().__init__(params, defaults, master_weights, stochastic_rounding, set_grad_none,
                         store_unscaled_grads, capturable, lean=lean)

    def _state_keys_for(self, group):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    def _translate_torch_group(self, group):
        # torch.optim.Adam/AdamW name decoupled weight decay 'decoupled_weight_decay' (AdamW:
        # always True): a torch AdamW checkpoint must keep stepping as AdamW here.
        if "adam_w_mode" not in group and "decoupled_weight_decay" in group:
            group["adam_w_mode"] = bool(group["decoupled_weight_decay"])

    def state_dict(self):
        # ...and the other way: torch.optim.Adam reads 'decoupled_weight_decay' (default False),
        # so our checkpoint says which Adam it is in torch's words too.
        sd = super().state_dict()
        for group in sd["param_groups"]:
            group["decoupled_weight_decay"] = bool(group["adam_w_mode"])
        return sd

    def _launch(self, group, params, grads, masters, states, lr, grad_scale, found_inf):
        beta1, beta2 = group["betas"]
        amsgrad = group["amsgrad"]
        torch.ops.peak.fused_adam_(
            params, grads, masters, [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["max_exp_avg_sq"] for s in states] if amsgrad else [],
            [s["step"] for s in states], lr, beta1, beta2, group["eps"], group["weight_decay"],
            amsgrad, group["adam_w_mode"], group["maximize"], group["bias_correction"],
            grad_scale, found_inf,
            stochastic_rounding_seed=self._rounding_seed(group, params),
            store_unscaled_grads=self._step_store_grads,
            **self._moment_args(group, states),
            **self._clip_args(group, lr.device))

    def _complete_loaded_state(self, p, state):
        super()._complete_loaded_state(p, state)
        group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)


class FusedLAMB(FusedOptimizer):
    """LAMB as Apex's FusedLAMB: Adam moments on globally norm-clipped gradients, then a
    per-tensor trust ratio ``||w|| / ||update||`` (applied when ``weight_decay != 0`` or
    ``use_nvlamb``). ``max_grad_norm=0`` disables clipping. ``exp_avg_dtype``,
    ``exp_avg_sq_dtype`` and ``moment_rounding`` as :class:`FusedAdam`'s (LAMB keeps fp32 masters:
    its trust ratio takes the norm of the fp32 weights)."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True,
                 set_grad_none=True, max_grad_norm=1.0, use_nvlamb=False, *,
                 master_weights=None, capturable=False, materialize_master_grads=True,
                 store_unscaled_grads=True, exp_avg_dtype=torch.float32,
                 exp_avg_sq_dtype=torch.float32, moment_rounding="stochastic",
                 store_param_remainders=False):
        if store_param_remainders:
            raise ValueError("FusedLAMB keeps fp32 masters (its trust ratio takes the norm of the "
                             "fp32 weights): store_param_remainders=True is for FusedAdam and "
                             "FusedSGD. bf16 moments (exp_avg_dtype, exp_avg_sq_dtype) are "
                             "available here")
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        _check_hyper("learning rate", lr, lo=0.0)
        _check_hyper("epsilon value", eps, lo=0.0)
        _check_hyper("beta parameter at index 0", betas[0], lo=0.0, hi=1.0, hi_open=True)
        _check_hyper("beta parameter at index 1", betas[1], lo=0.0, hi=1.0, hi_open=True)
        _check_hyper("weight_decay value", weight_decay, lo=0.0)
        _check_hyper("max_grad_norm", max_grad_norm, lo=0.0)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, adam_w_mode=adam_w_mode,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm,
                        use_nvlamb=use_nvlamb)
        _check_materialize(materialize_master_grads)
        lean = dict(exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype,
                    moment_rounding=moment_rounding)
        super().__init__(params, defaults, master_weights, set_grad_none=set_grad_none,
                         store_unscaled_grads=store_unscaled_grads, capturable=capturable,
                         lean=lean)

    _state_keys = ("exp_avg", "exp_avg_sq")

    def _launch(self, group, params, grads, masters, states, lr, grad_scale, found_inf):
        beta1, beta2 = group["betas"]
        # Apex clips by the norm of ALL gradients (every group and dtype): the base class's
        # global norm (or the one a loss scaler computed in its inf/NaN check).
        norm = self._step_grad_norm
        if norm is not None:
            norm = self._on(norm, lr.device)
        torch.ops.peak.fused_lamb_(
            params, grads, masters, [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states], [s["step"] for s in states], lr, beta1, beta2,
            group["eps"], group["weight_decay"], group["adam_w_mode"], group["grad_averaging"],
            group["bias_correction"], group["max_grad_norm"], group["use_nvlamb"], norm,
            grad_scale, found_inf, store_unscaled_grads=self._step_store_grads,
            **self._moment_args(group, states))
