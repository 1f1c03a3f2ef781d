"""``FP16_Optimizer``: Apex's deprecated wrapper, kept so that old scripts run. Use
``amp.initialize(model, optimizer, opt_level="O2")`` instead (the seeds' transition guide: O2 is
FP16_Optimizer with ``dynamic_loss_scale=True``).

It wraps any optimizer over a fp16/bf16 model: fp32 master copies replace the low-precision
parameters in the optimizer's ``param_groups``; ``backward(loss)`` scales the loss; gradients are
unscaled into the masters' ``.grad`` by one multi-tensor pass per (device, dtype) that also checks
for inf/NaN; ``step()`` skips on overflow (backing the scale off) or steps the masters and copies
them back into the model in one pass.
"""
from __future__ import annotations

import warnings
from collections import defaultdict

import torch

from .. import ops

_LOW = (torch.float16, torch.bfloat16)


class FP16_Optimizer:
    """Apex's ``FP16_Optimizer(init_optimizer, static_loss_scale=1.0, dynamic_loss_scale=False,
    dynamic_loss_args=None, verbose=True)``.

    ``dynamic_loss_args`` may set ``init_scale`` (default 2**32), ``scale_factor`` (2.0) and
    ``scale_window`` (1000), as Apex's DynamicLossScaler.
    """

    def __init__(self, init_optimizer, static_loss_scale=1.0, dynamic_loss_scale=False,
                 dynamic_loss_args=None, verbose=True):
        warnings.warn("FP16_Optimizer is deprecated: use peak.amp.initialize(model, optimizer, "
                      "opt_level='O2') and amp.scale_loss (see docs/amp_api.md)",
                      DeprecationWarning, stacklevel=2)
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise TypeError(f"init_optimizer must be a torch.optim.Optimizer, got "
                            f"{type(init_optimizer).__name__}")
        self.optimizer = init_optimizer
        self.verbose = verbose
        self.model_params: list[torch.Tensor] = []   # low-precision params, in group order
        self.master_params: list[torch.Tensor] = []  # their fp32 masters
        for group in self.optimizer.param_groups:
            new_params = []
            for p in group["params"]:
                if p.requires_grad and p.dtype in _LOW:
                    master = torch.nn.Parameter(p.detach().to(torch.float32, copy=True))
                    if p in self.optimizer.state:
                        self.optimizer.state[master] = self.optimizer.state.pop(p)
                    self.model_params.append(p)
                    self.master_params.append(master)
                    new_params.append(master)
                elif p.dtype == torch.float32 or not p.requires_grad:
                    new_params.append(p)
                else:
                    raise TypeError(f"FP16_Optimizer wraps float16, bfloat16 and float32 "
                                    f"parameters; got a {p.dtype} parameter")
            group["params"] = new_params
        if not self.model_params:
            raise ValueError("FP16_Optimizer found no float16/bfloat16 parameters in the "
                             "optimizer: convert the model with .half() first, or better, use "
                             "peak.amp.initialize(opt_level='O2') which does it for you")
        device = self.model_params[0].device
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        args = dict(init_scale=2.0 ** 32, scale_factor=2.0, scale_window=1000)
        if dynamic_loss_args is not None:
            unknown = set(dynamic_loss_args) - set(args)
            if unknown:
                raise ValueError(f"dynamic_loss_args: unknown keys {sorted(unknown)}; valid: "
                                 f"{sorted(args)}")
            args.update(dynamic_loss_args)
        self._scale_factor = float(args["scale_factor"])
        self._scale_window = int(args["scale_window"])
        init = args["init_scale"] if self.dynamic_loss_scale else float(static_loss_scale)
        self._scale = torch.full((1,), float(init), dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)
        self._found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        self.overflow = False
        self.first_closure_call_this_step = True

    # -- loss scale ------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self._scale.item()

    def backward(self, loss, update_master_grads=True, retain_graph=False):
        """``(loss.float() * loss_scale).backward()``, then (by default) unscale into the
        masters' gradients."""
        if loss.numel() != 1:
            raise ValueError(f"backward() needs a scalar loss, got shape {tuple(loss.shape)}")
        (loss.float() * self._scale).backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self):
        """Unscale the model's gradients into the masters' ``.grad`` (fp32), checking inf/NaN
        in the same pass (one per (device, dtype))."""
        self._found_inf.zero_()
        inv_scale = self._scale.reciprocal()
        groups = defaultdict(lambda: ([], []))
        for p, m in zip(self.model_params, self.master_params):
            if p.grad is None:
                m.grad = None
                continue
            if m.grad is None:
                m.grad = torch.empty_like(m)
            ins, outs = groups[(p.grad.device, p.grad.dtype)]
            ins.append(p.grad)
            outs.append(m.grad)
        for ins, outs in groups.values():
            ops.multi_tensor_scale_(ins, outs, inv_scale, self._found_inf)
        self.overflow = self.dynamic_loss_scale and bool(self._found_inf.item())

    def clip_master_grads(self, max_norm, norm_type=2):
        """Clip the masters' gradients; returns the total norm, or -1 on overflow (Apex)."""
        if self.overflow:
            return -1
        grads = [m for m in self.master_params if m.grad is not None]
        fp32 = [p for g in self.optimizer.param_groups for p in g["params"]
                if p.dtype == torch.float32 and p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(fp32 or grads, max_norm, norm_type).item()

    # -- step ------------------------------------------------------------------------------------
    def step(self, closure=None):
        if closure is not None:
            raise RuntimeError("FP16_Optimizer does not support closures here; call "
                               "backward(loss) then step()")
        if self.overflow:
            old = self.loss_scale
            self._update_scale()
            if self.verbose:
                print(f"OVERFLOW! Skipping step. Attempted loss scale: {old}, reducing to "
                      f"{self.loss_scale}")
            return None
        result = self.optimizer.step()
        self._copy_masters_to_model()
        self._update_scale()
        return result

    def _update_scale(self):
        if self.dynamic_loss_scale:
            ops.update_scale_(self._scale, self._growth_tracker, self._found_inf,
                              self._scale_factor, 1.0 / self._scale_factor, self._scale_window)

    @torch.no_grad()
    def _copy_masters_to_model(self):
        groups = defaultdict(lambda: ([], []))
        for p, m in zip(self.model_params, self.master_params):
            ins, outs = groups[(p.device, p.dtype)]
            ins.append(m)
            outs.append(p)
        flag = torch.zeros(1, device=self._scale.device)
        for ins, outs in groups.values():
            ops.multi_tensor_scale_(ins, outs, 1.0, flag)

    def zero_grad(self, set_grads_to_None=False):
        for p in self.model_params + self.master_params:
            if set_grads_to_None:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_().zero_()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.dtype == torch.float32 and p.grad is not None:
                    if set_grads_to_None:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self):
        return {
            "loss_scaler": {"loss_scale": self.loss_scale,
                            "growth_tracker": int(self._growth_tracker.item())},
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": [m.detach().clone() for m in self.master_params],
        }

    def load_state_dict(self, state_dict):
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self._scale.fill_(state_dict["loss_scaler"]["loss_scale"])
        self._growth_tracker.fill_(state_dict["loss_scaler"].get("growth_tracker", 0))
        self.overflow = state_dict["overflow"]
        self.first_closure_call_this_step = state_dict["first_closure_call_this_step"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        saved = state_dict["fp32_from_fp16"]
        if len(saved) != len(self.master_params):
            raise ValueError(f"checkpoint has {len(saved)} fp32 master weights, this optimizer "
                             f"has {len(self.master_params)}: not the same model")
        with torch.no_grad():
            for m, s in zip(self.master_params, saved):
                m.copy_(s)

    # Apex exposes the wrapped optimizer's param_groups and state.
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state
