"""LARC: layer-wise adaptive rate clipping/scaling around any optimizer (Apex's
``apex.parallel.LARC``, https://arxiv.org/abs/1708.03888)."""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..scaling import core_attribute


# What torch's Optimizer machinery keeps on an instance (torch's __init__ would make them).
_FIELDS = ("optim", "trust_coefficient", "clip", "eps")
_HOOKS = tuple(f"_optimizer_{when}_hooks" for when in (
    "step_pre", "step_post", "state_dict_pre", "state_dict_post", "load_state_dict_pre",
    "load_state_dict_post"))


class LARC(torch.optim.Optimizer):
    """Wraps ``optimizer`` and scales each parameter's gradient by a local learning rate
    ``trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + eps)`` before its step (the
    group's ``weight_decay`` is folded into the gradient here and switched off for the inner
    step, as Apex). ``clip=True``: the effective rate is ``min(local_lr, lr)``; ``clip=False``:
    ``local_lr * lr``. Parameters whose weight or gradient norm is 0 keep their gradient.

    ``param_groups``, ``state``, ``defaults``, ``state_dict()`` and ``load_state_dict()`` are the
    wrapped optimizer's, so checkpoints are interchangeable with the bare optimizer's. Unlike
    Apex's (a plain object) it is a ``torch.optim.Optimizer``: LR schedulers, ``amp.initialize``
    and GradScaler take it as they take any optimizer. GradScaler unscales the gradients before
    ``step()`` (the norms must be of true gradients), so LARC never asks it for the scale."""

    _step_supports_amp_scaling = False  # (the norms need unscaled gradients: see above)

    def __init__(self, optimizer, trust_coefficient=0.02, clip=True, eps=1e-8):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"LARC wraps a torch.optim.Optimizer (e.g. torch.optim.SGD or a "
                            f"peak.optimizers fused optimizer), got {type(optimizer).__name__}")
        if isinstance(optimizer, LARC):
            raise TypeError("LARC wraps the optimizer itself; this one is already a LARC")
        for name, value in (("trust_coefficient", trust_coefficient), ("eps", eps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if not isinstance(clip, bool):
            raise ValueError(f"clip must be True (clipping mode) or False (scaling mode), got "
                             f"{clip!r}")
        # Not Optimizer.__init__: the groups and state are the wrapped optimizer's. What torch's
        # Optimizer machinery reads from an instance (hooks) is set up here instead.
        self.optim = optimizer
        self.trust_coefficient = float(trust_coefficient)
        self.clip = clip
        self.eps = float(eps)
        for name in _HOOKS:
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    # -- the wrapped optimizer's groups and state ------------------------------------------------
    param_groups = core_attribute("param_groups", "optim")
    state = core_attribute("state", "optim")
    defaults = core_attribute("defaults", "optim")

    def __getstate__(self):  # (as torch's optimizers: its own fields only; no hooks, nor an LR
        return {k: self.__dict__[k] for k in _FIELDS}  # scheduler's step, nor what amp set)

    def __setstate__(self, state):
        self.__dict__.update(state)
        for name in _HOOKS:
            self.__dict__.setdefault(name, OrderedDict())
        self._patch_step_function()

    def __repr__(self):
        return (f"LARC(trust_coefficient={self.trust_coefficient}, clip={self.clip}, "
                f"eps={self.eps}, optimizer={self.optim!r})")

    def state_dict(self):
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state_dict = self.optim.state_dict()
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict):
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self.optim.load_state_dict(state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def zero_grad(self, set_to_none: bool | None = None):
        # None: the inner optimizer's own default (Apex's FusedSGD zeroes, torch's sets to None)
        if set_to_none is None:
            self.optim.zero_grad()
        else:
            self.optim.zero_grad(set_to_none)

    def add_param_group(self, param_group):
        self.optim.add_param_group(param_group)

    # -- the step --------------------------------------------------------------------------------
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        weight_decays = []
        with torch.no_grad():
            for group in self.optim.param_groups:
                weight_decay = group.get("weight_decay", 0.0)
                weight_decays.append(weight_decay)
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise RuntimeError("LARC does not support sparse gradients")
                    self._scale_grad(p, group["lr"], weight_decay)
        try:
            for group in self.optim.param_groups:
                if "weight_decay" in group:
                    group["weight_decay"] = 0.0  # folded into the gradient above
            self.optim.step()
        finally:  # the groups get their weight decay back even when the step raises
            for group, weight_decay in zip(self.optim.param_groups, weight_decays):
                if "weight_decay" in group:
                    group["weight_decay"] = weight_decay
        return loss

    def _scale_grad(self, p, lr, weight_decay) -> None:
        """Apex's local rate on the device (no host sync): where a norm is 0 the gradient is
        left as it is, else ``grad = (grad + weight_decay * w) * local_lr``."""
        grad, acc = p.grad, torch.promote_types(p.dtype, torch.float32)  # (float64 stays)
        param_norm = torch.linalg.vector_norm(p.detach(), dtype=acc)
        grad_norm = torch.linalg.vector_norm(grad, dtype=acc)
        adaptive_lr = self.trust_coefficient * param_norm / (
            grad_norm + param_norm * weight_decay + self.eps)
        if self.clip:
            adaptive_lr = torch.clamp(adaptive_lr / lr, max=1.0)
        active = (param_norm != 0) & (grad_norm != 0)
        new_grad = (grad.to(acc) + weight_decay * p.detach().to(acc)) * adaptive_lr
        grad.copy_(torch.where(active, new_grad, grad.to(acc)))
