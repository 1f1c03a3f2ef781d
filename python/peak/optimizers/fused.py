"""FusedSGD, FusedAdam, FusedAdamW, FusedLAMB, FusedMixedPrecisionLamb, FusedAdagrad and
FusedNovoGrad: torch.optim-compatible optimizers whose step is one C++ kernel per (device, dtype)
bucket -- unscale, skip on overflow, master and state update, low-precision weight write -- on
CPU and CUDA. See NOTE: [Fused master-weight step]."""
from __future__ import annotations

import torch

from .. import ops
from ..scaling import merge_flags
from ._arguments import (check_adam_hypers, check_bool, check_hyper, check_moment_dtype,
                         check_nesterov, check_norm_type)
from ._base import FusedOptimizer
from ._sharded import whole_tensor_norms

# The kernel's scale-list arguments for 8-bit moments, and the state keys they come from.
_ADAM_SCALES = {"exp_avg_scales": "exp_avg", "exp_avg_sq_scales": "exp_avg_sq"}


def _check_materialize(materialize_master_grads) -> None:
    """Apex's option (fp32 master gradients unless False): peak's step reads the fp16/bf16
    gradients directly and never builds them, so both values step alike."""
    check_bool("materialize_master_grads", materialize_master_grads)


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
        for name, value in (("learning rate", lr), ("momentum value", momentum),
                            ("weight_decay value", weight_decay), ("max_grad_norm", max_grad_norm)):
            check_hyper(name, value)
        check_nesterov(nesterov, momentum, dampening)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, max_grad_norm=float(max_grad_norm))
        lean = dict(store_param_remainders=store_param_remainders, momentum_dtype=momentum_dtype,
                    moment_rounding=moment_rounding)
        super().__init__(params, defaults, master_weights, stochastic_rounding, set_grad_none,
                         store_unscaled_grads, capturable, lean=lean)

    _all_state_keys = _mid_run_state_keys = ("momentum_buffer",)  # (momentum warm-up from 0)
    _loaded_step_required = False  # torch.optim.SGD keeps none (see _complete_loaded_state)

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
        ops.fused_sgd_(
            params, grads, masters, buffers, [s["step"] for s in states], lr=lr,
            momentum=group["momentum"], dampening=group["dampening"],
            weight_decay=group["weight_decay"],
            nesterov=group["nesterov"] and group["momentum"] != 0,  # (as torch's step: no term)
            maximize=group["maximize"], grad_scale=grad_scale, found_inf=found_inf,
            stochastic_rounding_seed=self._rounding_seed(group, params),
            store_unscaled_grads=self._step_store_grads, **self._moment_args(group, states),
            **self._clip_args(group, lr.device),
            **self._scale_args(states if buffers else [], {"momentum_scales": "momentum_buffer"}))

    def _complete_loaded_state(self, p, state):
        had_step = "step" in state
        super()._complete_loaded_state(p, state)
        if not had_step and "momentum_buffer" in state:
            state["step"].fill_(1.0)  # a torch.optim.SGD buffer: momentum is already seeded


class FusedAdam(FusedOptimizer):
    """Adam, or AdamW with ``adam_w_mode=True`` (decoupled weight decay), as ``torch.optim.Adam``
    / ``AdamW``, in torch.optim.Adam's argument order and with its ``adam_w_mode=False`` default
    (Apex's FusedAdam defaults to AdamW: pass ``adam_w_mode=True`` for Apex's behaviour).
    ``amsgrad``, ``bias_correction`` and ``set_grad_none`` as Apex's FusedAdam; ``master_weights``,
    ``stochastic_rounding`` and ``max_grad_norm`` as for :class:`FusedSGD`.

    Lean state (docs/core.md, "Lean optimizer state"): ``store_param_remainders=True`` keeps each
    bf16 parameter's exact fp32 master as the 16 low bits its weight drops (the weight: the master
    rounded to nearest, ties away from zero); ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` store the
    moments as ``torch.float32``, ``torch.bfloat16`` or ``torch.uint8`` (8-bit block-quantized:
    codes and one fp32 scale per 256 elements, ``state["exp_avg_scale"]``...; both or neither),
    or as the strings ``"fp32"``, ``"bf16"``, ``"8bit"``. ``moment_rounding``: ``"stochastic"``
    (the default) or ``"nearest"`` (even) for bf16 moments. A bf16 model with remainders keeps 10
    bytes per parameter with bf16 moments, ~8.03 with 8-bit ones, against 16 for fp32 state."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, adam_w_mode=False, bias_correction=True, maximize=False,
                 master_weights=None, stochastic_rounding=False, max_grad_norm=0.0,
                 set_grad_none=True, capturable=False, materialize_master_grads=True,
                 store_unscaled_grads=True, store_param_remainders=False,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 moment_rounding="stochastic"):
        check_adam_hypers(lr, eps, betas, weight_decay, max_grad_norm)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, adam_w_mode=adam_w_mode, bias_correction=bias_correction,
                        maximize=maximize, max_grad_norm=float(max_grad_norm))
        _check_materialize(materialize_master_grads)
        exp_avg_dtype = check_moment_dtype("exp_avg_dtype", exp_avg_dtype)
        exp_avg_sq_dtype = check_moment_dtype("exp_avg_sq_dtype", exp_avg_sq_dtype)
        lean = dict(store_param_remainders=store_param_remainders, exp_avg_dtype=exp_avg_dtype,
                    exp_avg_sq_dtype=exp_avg_sq_dtype, moment_rounding=moment_rounding)
        super().__init__(params, defaults, master_weights, stochastic_rounding, set_grad_none,
                         store_unscaled_grads, capturable, lean=lean)

    _all_state_keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    _mid_run_state_keys = ("max_exp_avg_sq",)  # amsgrad switched on after some steps

    def _state_keys_for(self, group):
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())

    # torch.optim.Adam's name of an option of ours, which the step refuses to see disagree
    _torch_synonyms = {"decoupled_weight_decay": "adam_w_mode"}

    def _translate_torch_group(self, group):
        # torch.optim.Adam/AdamW name decoupled weight decay 'decoupled_weight_decay' (AdamW:
        # always True): a torch AdamW checkpoint must keep stepping as AdamW here.
        if "adam_w_mode" not in group and "decoupled_weight_decay" in group:
            group["adam_w_mode"] = bool(group["decoupled_weight_decay"])
        if "decoupled_weight_decay" in group:  # (loaded: it says what the step does)
            group["decoupled_weight_decay"] = bool(group["adam_w_mode"])

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
        ops.fused_adam_(
            params, grads, masters, [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["max_exp_avg_sq"] for s in states] if amsgrad else [],
            [s["step"] for s in states], lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], amsgrad=amsgrad, adam_w_mode=group["adam_w_mode"],
            maximize=group["maximize"], bias_correction=group["bias_correction"],
            grad_scale=grad_scale, found_inf=found_inf,
            stochastic_rounding_seed=self._rounding_seed(group, params),
            store_unscaled_grads=self._step_store_grads, **self._moment_args(group, states),
            **self._clip_args(group, lr.device), **self._scale_args(states, _ADAM_SCALES))

    def _complete_loaded_state(self, p, state):
        super()._complete_loaded_state(p, state)
        if self._group_of(p)["amsgrad"] and "max_exp_avg_sq" not in state:
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
        check_adam_hypers(lr, eps, betas, weight_decay, max_grad_norm)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, adam_w_mode=adam_w_mode,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm,
                        use_nvlamb=use_nvlamb)
        _check_materialize(materialize_master_grads)
        super().__init__(params, defaults, master_weights, set_grad_none=set_grad_none,
                         store_unscaled_grads=store_unscaled_grads, capturable=capturable,
                         lean=dict(exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype,
                                   moment_rounding=moment_rounding))

    _state_keys = ("exp_avg", "exp_avg_sq")
    _takes_tensor_norms = True

    def _launch(self, group, params, grads, masters, states, lr, grad_scale, found_inf):
        beta1, beta2 = group["betas"]
        # Apex clips by the norm of ALL gradients (every group and dtype): the base class's
        # global norm (or the one a loss scaler computed in its inf/NaN check).
        norm = self._on(self._step_grad_norm, lr.device)

        def lamb(**stage):
            ops.fused_lamb_(
                params, grads, masters, [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states], [s["step"] for s in states], lr=lr,
                beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                adam_w_mode=group["adam_w_mode"], grad_averaging=group["grad_averaging"],
                bias_correction=group["bias_correction"], max_grad_norm=group["max_grad_norm"],
                use_nvlamb=group["use_nvlamb"], grad_norm=norm, grad_scale=grad_scale,
                found_inf=found_inf, store_unscaled_grads=self._step_store_grads,
                **self._moment_args(group, states), **self._scale_args(states, _ADAM_SCALES),
                **stage)

        whole = self._bucket_shards
        if whole is None:
            return lamb()
        # Shards: the trust ratio's norms are of whole tensors (NOTE: [LAMB in two calls]).
        updates = [torch.empty_like(p, dtype=torch.float32,
                                    memory_format=torch.contiguous_format) for p in params]
        lamb(updates=updates)
        weight_norms, update_norms = whole_tensor_norms([masters or params, updates], whole)
        lamb(updates=updates, weight_norms=weight_norms, update_norms=update_norms)


class FusedAdamW(FusedAdam):
    """``torch.optim.AdamW`` fused: :class:`FusedAdam` with decoupled weight decay, in AdamW's
    argument order and with its defaults (``weight_decay=1e-2``). ``FusedAdam(weight_decay=...)``
    applies L2 decay (torch's Adam) unless ``adam_w_mode=True``; this class cannot."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, adam_w_mode=True, **kwargs):
        if adam_w_mode is not True:
            raise ValueError("FusedAdamW always decouples weight decay (adam_w_mode=True); for "
                             "L2 weight decay added to the gradient use FusedAdam(..., "
                             "adam_w_mode=False)")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, adam_w_mode=True, **kwargs)

    def _translate_torch_group(self, group):
        group["adam_w_mode"] = True  # any checkpoint loaded here keeps stepping as AdamW
        super()._translate_torch_group(group)


class FusedAdagrad(FusedOptimizer):
    """Adagrad as Apex's FusedAdagrad (Apex's arguments in Apex's positions; ``adagrad_w_mode``:
    decoupled weight decay ``w -= lr * (g / (sqrt(sum) + eps) + weight_decay * w)``), which is
    ``torch.optim.Adagrad`` without it. ``lr_decay`` and ``initial_accumulator_value`` (keywords)
    are torch.optim.Adagrad's. State: ``sum`` (fp32) and ``step`` per parameter, as torch's, so a
    torch.optim.Adagrad checkpoint loads. ``master_weights`` as for :class:`FusedSGD`."""

    def __init__(self, params, lr=1e-2, eps=1e-10, weight_decay=0.0, set_grad_none=True,
                 adagrad_w_mode=False, *, lr_decay=0.0, initial_accumulator_value=0.0,
                 master_weights=None, capturable=False, materialize_master_grads=True,
                 store_unscaled_grads=True):
        for name, value in (("learning rate", lr), ("epsilon value", eps),
                            ("weight_decay value", weight_decay), ("lr_decay", lr_decay),
                            ("initial_accumulator_value", initial_accumulator_value)):
            check_hyper(name, value)
        check_bool("adagrad_w_mode", adagrad_w_mode)
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, adagrad_w_mode=adagrad_w_mode,
                        lr_decay=lr_decay, initial_accumulator_value=initial_accumulator_value)
        _check_materialize(materialize_master_grads)
        super().__init__(params, defaults, master_weights, set_grad_none=set_grad_none,
                         store_unscaled_grads=store_unscaled_grads, capturable=capturable)

    _state_keys = ("sum",)
    _loaded_step_required = False  # Apex's FusedAdagrad keeps only 'sum'

    def _init_state(self, p, group):
        fresh = "sum" not in self.state[p]
        state = super()._init_state(p, group)
        if fresh:  # torch.optim.Adagrad starts the sums here
            state["sum"].fill_(float(group["initial_accumulator_value"]))
        return state

    def load_state_dict(self, state_dict):
        # Checked before anything loads: a torch Adagrad that maximized would silently minimize.
        for i, group in enumerate(state_dict["param_groups"]):
            if group.get("maximize", False):
                raise ValueError(
                    f"this checkpoint's param_groups[{i}] comes from "
                    "torch.optim.Adagrad(maximize=True), which FusedAdagrad does not provide; "
                    "keep stepping it with torch.optim.Adagrad (or negate the loss)")
        super().load_state_dict(state_dict)

    def _launch(self, group, params, grads, masters, states, lr, grad_scale, found_inf):
        ops.fused_adagrad_(
            params, grads, masters, [s["sum"] for s in states], [s["step"] for s in states],
            lr=lr, eps=group["eps"], weight_decay=group["weight_decay"],
            adagrad_w_mode=group["adagrad_w_mode"], lr_decay=group["lr_decay"],
            grad_scale=grad_scale, found_inf=found_inf, store_unscaled_grads=self._step_store_grads)


class FusedNovoGrad(FusedOptimizer):
    """NovoGrad as Apex's FusedNovoGrad (Apex's arguments in Apex's positions): a per-layer
    second moment of the gradient's norm (``norm_type`` 2: L2, 0: infinity norm; started at the
    first step's norm unless ``init_zero``), element-wise first moments, weight decay on the
    update (or, with ``reg_inside_moment=True``, inside the momentum). ``master_weights`` as for
    :class:`FusedSGD`.

    State per parameter: ``exp_avg`` (fp32, like the parameter), ``exp_avg_sq`` (a 0-dim fp32
    tensor: the running norm, not its square, as Apex's), ``step``. Apex kept the norms in one
    tensor per group and a step count per group; per parameter they survive ``add_param_group``
    and ``state_dict`` like any other state."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, amsgrad=False, reg_inside_moment=False, grad_averaging=True,
                 norm_type=2, init_zero=False, set_grad_none=True, *, master_weights=None,
                 capturable=False, materialize_master_grads=True, store_unscaled_grads=True):
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant.")
        check_norm_type(norm_type)
        check_adam_hypers(lr, eps, betas, weight_decay)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, reg_inside_moment=reg_inside_moment,
                        grad_averaging=grad_averaging, norm_type=norm_type, init_zero=init_zero)
        _check_materialize(materialize_master_grads)
        super().__init__(params, defaults, master_weights, set_grad_none=set_grad_none,
                         store_unscaled_grads=store_unscaled_grads, capturable=capturable)

    _state_keys = ("exp_avg",)
    _all_state_keys = ("exp_avg", "exp_avg_sq")
    _also_required_state_keys = _scalar_state_keys = ("exp_avg_sq",)  # one norm per parameter
    _takes_tensor_norms = True

    def _init_state(self, p, group):
        state = super()._init_state(p, group)
        if "exp_avg_sq" not in state:
            state["exp_avg_sq"] = torch.zeros((), dtype=torch.float32, device=p.device)
        return state

    def _launch(self, group, params, grads, masters, states, lr, grad_scale, found_inf):
        beta1, beta2 = group["betas"]
        shard_args = {}
        if self._bucket_shards is not None:  # the norms of whole tensors (NOTE: [Sharded steps])
            shard_args["grad_norms"] = whole_tensor_norms(
                [grads], self._bucket_shards, 2.0 if group["norm_type"] == 2 else float("inf"))[0]
        ops.fused_novograd_(
            params, grads, masters, [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states], [s["step"] for s in states], lr=lr, beta1=beta1,
            beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
            grad_averaging=group["grad_averaging"], reg_inside_moment=group["reg_inside_moment"],
            bias_correction=group["bias_correction"], norm_type=group["norm_type"],
            init_zero=group["init_zero"], grad_scale=grad_scale, found_inf=found_inf,
            store_unscaled_grads=self._step_store_grads, **shard_args)

    def _complete_loaded_state(self, p, state):
        super()._complete_loaded_state(p, state)
        if "exp_avg_sq" in state:
            state["exp_avg_sq"] = state["exp_avg_sq"].reshape(())

    def load_state_dict(self, state_dict):
        """Also Apex's FusedNovoGrad checkpoints, whose running norms are per group:
        ``group["exp_avg_sq"] = [norms of the fp16 params, norms of the fp32 params]`` in group
        order; they become each parameter's ``exp_avg_sq``."""
        state_dict = dict(state_dict)
        state = {pid: dict(st) for pid, st in state_dict["state"].items()}
        groups = []
        for i, group in enumerate(state_dict["param_groups"]):
            norms = group.get("exp_avg_sq")
            if isinstance(norms, (list, tuple)):
                half = [pid for pid in group["params"] if pid in state
                        and state[pid].get("exp_avg") is not None
                        and self._saved_dtype(state_dict, pid) != torch.float32]
                full = [pid for pid in group["params"] if pid in state and pid not in half]
                sizes = [n.numel() if isinstance(n, torch.Tensor) else 0 for n in norms]
                if len(norms) != 2 or sizes != [len(half), len(full)]:
                    raise ValueError(
                        f"param_groups[{i}] holds Apex FusedNovoGrad's per-group norms "
                        f"(exp_avg_sq of sizes {sizes}) that do not match its {len(half)} "
                        f"fp16/bf16 and {len(full)} fp32 parameters with state; load it into "
                        "an optimizer over the same parameters in the same order")
                for pids, values in ((half, norms[0]), (full, norms[1])):
                    for pid, value in zip(pids, values.reshape(-1)):
                        state[pid].setdefault("exp_avg_sq", value.float().clone())
                group = {k: v for k, v in group.items() if k != "exp_avg_sq"}
            groups.append(group)
        state_dict["state"], state_dict["param_groups"] = state, groups
        super().load_state_dict(state_dict)

    def _saved_dtype(self, state_dict, pid):
        """The dtype of the parameter a saved id stands for (the optimizer's own, same order)."""
        saved = [q for g in state_dict["param_groups"] for q in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        return params[saved.index(pid)].dtype if pid in saved and saved.index(pid) < len(params) \
            else torch.float32


class FusedMixedPrecisionLamb(FusedLAMB):
    """Apex's FusedMixedPrecisionLamb: :class:`FusedLAMB` (the same math: Adam moments on
    gradients clipped by their global norm, per-tensor trust ratio) with Apex's arguments --
    ``step`` (the step count to start from) and ``reduced_precision_dtype`` -- and its step
    signature ``step(closure=None, grad_scaler=None)``.

    Every fp16/bf16 parameter gets fp32 master weights and fp32 moments (Apex: only parameters
    of ``reduced_precision_dtype``; others it stepped in their own precision). A ``grad_scaler``
    passed to ``step`` (Apex's contract) is asked for its scale and inf/NaN check; a scaler's own
    ``scaler.step(optimizer)`` hands both over as with every fused optimizer."""

    def __init__(self, params, lr=1e-3, step=0, bias_correction=True, betas=(0.9, 0.999),
                 eps=1e-6, weight_decay=0.01, amsgrad=False, adam_w_mode=True,
                 grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False,
                 reduced_precision_dtype=None, *, master_weights=None, capturable=False,
                 materialize_master_grads=True, store_unscaled_grads=True):
        if reduced_precision_dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(f"reduced_precision_dtype must be None, torch.float16 or "
                             f"torch.bfloat16, got {reduced_precision_dtype!r}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step (the step count to start from) must be an int >= 0, got "
                             f"{step!r}")
        self.reduced_precision_dtype = reduced_precision_dtype
        self._initial_step = step
        super().__init__(params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
                         adam_w_mode, grad_averaging, True, max_grad_norm, use_nvlamb,
                         master_weights=master_weights, capturable=capturable,
                         materialize_master_grads=materialize_master_grads,
                         store_unscaled_grads=store_unscaled_grads)

    def _init_state(self, p, group):
        fresh = "step" not in self.state[p]
        state = super()._init_state(p, group)
        if fresh:
            state["step"].fill_(float(getattr(self, "_initial_step", 0)))
        return state

    def step(self, closure=None, *apex_args, grad_scale=None, found_inf=None, grad_norm=None,
             **apex_kwargs):
        # grad_scaler travels in *args/**kwargs, not as a named parameter: a GradScaler that
        # sees 'grad_scaler' in the signature passes itself (with a FutureWarning) instead of
        # handing over grad_scale/found_inf. Apex's signature is step(closure, grad_scaler).
        if len(apex_args) > 1:
            raise TypeError(f"FusedMixedPrecisionLamb.step() takes closure and grad_scaler, got "
                            f"{1 + len(apex_args)} positional arguments")
        grad_scaler = apex_args[0] if apex_args else None
        if "grad_scaler" in apex_kwargs:
            if apex_args:
                raise TypeError("FusedMixedPrecisionLamb.step() got grad_scaler twice")
            grad_scaler = apex_kwargs.pop("grad_scaler")
        if apex_kwargs:
            raise TypeError(f"FusedMixedPrecisionLamb.step() got unexpected keyword arguments "
                            f"{sorted(apex_kwargs)}")
        scaling = grad_scaler is not None and getattr(grad_scaler, "_enabled", True)
        if scaling and (grad_scale is not None or found_inf is not None):
            raise ValueError("pass either grad_scaler or grad_scale/found_inf, not both")
        loss = None
        if closure is not None and grad_scaler is not None:  # (Apex: the closure's gradients
            with torch.enable_grad():                          # are the ones checked)
                loss = closure()
            closure = None
        if scaling:
            per_device = grad_scaler._check_inf_per_device(self)
            grad_scale = grad_scaler._get_scale_async()
            if per_device:
                found_inf = merge_flags(per_device.values(), grad_scale.device)
        result = FusedOptimizer.step(self, closure, grad_scale=grad_scale, found_inf=found_inf,
                                     grad_norm=grad_norm)  # (not FusedLAMB's: once hooked, twice)
        return result if loss is None else loss
