"""The fused optimizers' argument checks (hyperparameter ranges, lean-state options, one master
each), the warnings about scaled gradients amp O2 hands a fused step, and the torch optimizer
behind a wrapper."""
from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .._dtypes import MOMENT_STORAGE, parse_dtype
from .._stacklevel import user_stacklevel


# A group's lean-state options (docs/core.md, "Lean optimizer state").
LEAN_KEYS = ("store_param_remainders", "exp_avg_dtype", "exp_avg_sq_dtype", "momentum_dtype",
             "moment_rounding")


def check_moment_dtype(name, value):
    """A moment storage argument as a dtype: torch.float32, torch.bfloat16 or torch.uint8
    (8-bit block-quantized), or one of their strings ("fp32", "bf16", "8bit"...)."""
    return parse_dtype(value, name, MOMENT_STORAGE, allow_none=False)


def check_bool(name, value) -> None:
    if not isinstance(value, bool):  # (0.0 == False: a shifted positional argument)
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_moment_rounding(value):
    if value not in ("stochastic", "nearest"):
        raise ValueError(f"moment_rounding must be 'stochastic' (bf16 moments rounded up or down "
                         f"at random, in proportion; the default) or 'nearest', got {value!r}")


def check_lean(lean: dict | None, master_weights) -> dict:
    """The lean-state options (remainders, moment storage and rounding), checked and normalized."""
    lean = dict(lean or {})
    if not lean:
        return lean
    check_bool("store_param_remainders", lean.get("store_param_remainders", False))
    if lean.get("store_param_remainders") and master_weights is False:
        raise ValueError("store_param_remainders=True keeps the masters of bf16 weights as "
                         "16-bit remainders; it needs master weights: leave "
                         "master_weights=None (or True)")
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype", "momentum_dtype"):
        if key in lean:
            lean[key] = check_moment_dtype(key, lean[key])
    q8 = [k for k in ("exp_avg_dtype", "exp_avg_sq_dtype") if lean.get(k) == torch.uint8]
    if len(q8) == 1:
        other = ({"exp_avg_dtype", "exp_avg_sq_dtype"} - set(q8)).pop()
        raise ValueError(f"{q8[0]}=torch.uint8 (8-bit block-quantized moments) needs "
                         f"{other}=torch.uint8 as well: both moments are 8-bit or neither")
    check_moment_rounding(lean.get("moment_rounding", "stochastic"))
    return lean


def check_storage(name: str, options: dict, defaults: dict, master_weights) -> dict:
    """A group's storage options (``options``: the group over the defaults), as the constructor
    checks them: when a group is added, and before state converts to options set on a group
    mid-run. Returns them normalized (dtype strings as dtypes)."""
    foreign = [k for k in LEAN_KEYS if k in options and k not in defaults]
    if foreign:
        raise ValueError(f"{name} does not take {foreign[0]} (its constructor has no such "
                         "option): remove it from the param group")
    lean = check_lean({k: options[k] for k in LEAN_KEYS if k in options}, master_weights)
    if options.get("amsgrad") and any(lean.get(k, torch.float32) != torch.float32
                                      for k in ("exp_avg_dtype", "exp_avg_sq_dtype")):
        raise ValueError("amsgrad=True keeps fp32 moments: leave exp_avg_dtype and "
                         "exp_avg_sq_dtype at torch.float32, or set amsgrad=False (bf16 "
                         "and 8-bit moments are for Adam without amsgrad)")
    return lean


def check_unique(name: str, params: list) -> None:
    """A group's parameters, when it is added: each once (torch.optim steps a repeated one once
    per entry, and deprecates that)."""
    if len({id(p) for p in params}) != len(params):
        raise ValueError(f"{name}: a param group holds a parameter twice (torch.optim steps it "
                         "once per entry, and deprecates that): pass each parameter once")


def check_hyper(name, value, lo=0.0, below=None):
    """A hyperparameter in [lo, below), or [lo, inf) without `below`."""
    if isinstance(value, bool) or not hasattr(value, "__float__"):  # (numbers, 0-d arrays)
        raise ValueError(f"Invalid {name}: {value!r} (must be a number)")
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got shape "
                             f"{tuple(value.shape)}")
        value = value.item()  # checked once, at construction, as torch does
    if not (value >= lo and (below is None or value < below)):
        hi_s = f"{below})" if below is not None else "inf)"
        raise ValueError(f"Invalid {name}: {value} (must be in [{lo}, {hi_s})")


def check_betas(betas) -> None:
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r} (Apex's FusedAdam "
                         "takes bias_correction third: pass arguments by keyword, or import "
                         "apex.optimizers under peak's Apex alias for Apex's order)")
    for i in (0, 1):
        check_hyper(f"beta parameter at index {i}", betas[i], below=1.0)


def check_adam_hypers(lr, eps, betas, weight_decay, max_grad_norm=0.0) -> None:
    """The Adam family's ranges (FusedAdam, FusedLAMB, FusedNovoGrad), with torch's messages."""
    check_hyper("learning rate", lr)
    check_hyper("epsilon value", eps)
    check_betas(betas)
    check_hyper("weight_decay value", weight_decay)
    check_hyper("max_grad_norm", max_grad_norm)


# A param group's own numbers (add_param_group, or a dict in params), in the constructors' words.
_GROUP_RANGES = {"lr": "learning rate", "eps": "epsilon value", "momentum": "momentum value",
                 "weight_decay": "weight_decay value", "dampening": "dampening",
                 "max_grad_norm": "max_grad_norm", "lr_decay": "lr_decay",
                 "initial_accumulator_value": "initial_accumulator_value"}


def check_group(group: dict, defaults: dict) -> None:
    """The options a param group sets itself, checked as the constructor checks its own (a typo
    in moment_rounding, a negative lr); storage dtypes given as strings become dtypes."""
    for key, value in group.items():
        if key in _GROUP_RANGES:
            check_hyper(_GROUP_RANGES[key], value)
        elif key == "betas":
            check_betas(value)
        elif key == "moment_rounding":
            check_moment_rounding(value)
        elif key in ("exp_avg_dtype", "exp_avg_sq_dtype", "momentum_dtype"):
            group[key] = check_moment_dtype(key, value)
        elif key == "norm_type":
            check_norm_type(value)
        elif isinstance(defaults.get(key), bool):
            check_bool(key, value)


def check_norm_type(norm_type) -> None:
    if norm_type not in (0, 2) or isinstance(norm_type, bool):
        raise ValueError(f"norm_type must be 2 (L2 norm) or 0 (infinity norm), got {norm_type!r}")


def check_nesterov(nesterov, momentum, dampening) -> None:
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")


def check_one_master_each(holders, where: str) -> None:
    """Refuse a parameter held twice where amp or FP16_Optimizer keep a master of it per holder
    (per entry, for a torch optimizer) or unscale its gradient per holder: only one update would
    reach the model, or the gradient be unscaled twice (silently). ``holders``: (name, params)."""
    seen: dict = {}
    for name, params in holders:
        for p in params:
            names = seen.setdefault(id(p), [])
            names.append(name)
            if len(names) > 1:
                raise ValueError(
                    f"A parameter of shape {tuple(p.shape)} is held more than once (by "
                    f"{' and '.join(names)}): {where}, each holder keeps its own fp32 master of "
                    "it or unscales its gradient again, so an update would be lost or scaled "
                    "wrong. Give each parameter to one optimizer, once (param groups for "
                    "different settings).")


def grad_versions(params) -> list:
    """Each gradient of ``params`` with its version counter: what an amp O2 exit checked and left
    scaled for a fused optimizer. Views (DDP's bucket views) are left out: a view shares its
    base's counter, so another gradient's change in the same bucket would look like its own."""
    return [(p, p.grad, p.grad._version) for p in params
            if p.grad is not None and p.grad._base is None]


def warn_changed_grads(handed: list | None, name: str) -> None:
    """Warn when a gradient of ``handed = grad_versions(params)`` (None: nothing to compare) was
    changed in place since: still scaled, a norm or value clip of it acted on scaled values."""
    if handed is not None and any(p.grad is g and g._version != v for p, g, v in handed):
        warnings.warn(
            f"{name}: the model's gradients were changed in place after amp.scale_loss's exit. "
            "Under O2 a fused optimizer reads them still scaled by the loss scale: a change that "
            "does not depend on the scale (zeroing rows, averaging) is fine, but a clip by norm "
            "or value (clip_grad_norm_(model.parameters())) acted on scaled values and shrank "
            "the update by about the scale. Clip amp.master_params(optimizer) instead (fp32, "
            "unscaled), or pass max_grad_norm= to the optimizer.",
            stacklevel=user_stacklevel())  # the script's step() or master_params read


def warn_bare_masters(name: str) -> None:
    """An amp O2 fused step reading the model's gradients after ``amp.master_params`` gave the
    masters without any (a list taken before the backward): clipping that list clipped nothing."""
    warnings.warn(
        f"{name}.step(): amp.master_params(optimizer) was read before this step's backward, when "
        "the fp32 master weights had no gradients; under O2 a fused optimizer gives them "
        "gradients only when amp.master_params is called after the scale_loss block, so a "
        "list of them taken earlier has none: a clip of it clips nothing. Clip "
        "amp.master_params(optimizer) called after the backward, each step. (Reading the "
        "masters for an EMA or a log is fine: this is said once per optimizer.)",
        stacklevel=user_stacklevel())  # the script's step()


def warn_bypassed_masters(name: str) -> bool:
    """An amp O2 step whose fp32 masters have no gradients where the model's weights have some:
    a plain ``loss.backward()`` (only ``scale_loss`` fills the masters', in Apex too)."""
    warnings.warn(
        f"{name}.step(): the model's fp16/bf16 parameters have gradients but their fp32 master "
        "weights (stepped under O2) have none, so this step leaves those weights unchanged: run "
        "the backward pass as `with amp.scale_loss(loss, optimizer) as scaled_loss: "
        "scaled_loss.backward()` per step.", UserWarning, stacklevel=user_stacklevel())
    return True  # (said once per optimizer)


def wrapper_chain(optimizer):
    """``optimizer``, then what it wraps, outermost first: each object a wrapper keeps in
    ``.optimizer`` (Accelerate's ``AcceleratedOptimizer``, ``FP16_Optimizer``), ``.optim``
    (``LARC``) or ``.base_optimizer`` / ``._base_optimizer`` (timm's ``Lookahead``, earlier and
    later) and whose ``param_groups`` it shares."""
    for _ in range(8):  # wrappers of wrappers, not a cycle
        yield optimizer
        groups = None if isinstance(optimizer, type) else getattr(optimizer, "param_groups", None)
        inners = (getattr(optimizer, attr, None)
                  for attr in ("optimizer", "optim", "base_optimizer", "_base_optimizer"))
        optimizer = next((inner for inner in inners if inner is not None and inner is not optimizer
                          and getattr(inner, "param_groups", None) is groups is not None), None)
        if optimizer is None:
            return


def inner_optimizer(optimizer):
    """The torch optimizer behind wrappers that share its ``param_groups`` (``wrapper_chain``),
    else ``optimizer``: amp sets up the inner optimizer, and the wrapper keeps working around it."""
    inner = optimizer
    for wrapped in wrapper_chain(optimizer):
        if wrapped is not optimizer and not isinstance(wrapped, torch.optim.Optimizer):
            break
        inner = wrapped
    return inner
