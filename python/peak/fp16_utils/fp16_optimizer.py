"""``FP16_Optimizer``: Apex's deprecated wrapper, kept so that old scripts run (docs/migrating.md,
"From FP16_Optimizer")."""
from __future__ import annotations

import math
import warnings

import torch

from ..optimizers.masters import (LOW_DTYPES, MasterWeights, check_one_master_each, own_grad,
                                  unscaled_sparse, zero_in_place)
from ..scaling import LossScale, core_attribute


class FP16_Optimizer:
    """Apex's ``FP16_Optimizer(init_optimizer, static_loss_scale=1.0, dynamic_loss_scale=False,
    dynamic_loss_args=None, verbose=True)``, deprecated: ``amp.initialize(model, optimizer,
    opt_level="O2")`` is FP16_Optimizer with ``dynamic_loss_scale=True``.

    fp32 master copies replace the fp16/bf16 parameters in the wrapped optimizer's
    ``param_groups`` (fp32 parameters are their own masters). ``backward(loss)`` scales the loss
    and unscales every gradient into the masters (fp32 ones in place), checking them for inf/NaN;
    ``step()`` skips on overflow (backing the scale off; printed if ``verbose``) or steps the
    masters and copies them into the model. ``dynamic_loss_args`` may set ``init_scale`` (default
    2**16), ``scale_factor`` (2.0), ``scale_window`` (2000), ``min_loss_scale`` (None) and
    ``max_loss_scale`` (2**24), as Apex's FP16_Optimizer (over amp's LossScaler since 2019; the
    scale is updated once per step). As in Apex, per parameter group: ``fp16_groups`` (the model's
    fp16/bf16 parameters), ``fp32_from_fp16_groups`` (their fp32 masters) and
    ``fp32_from_fp32_groups`` (fp32 parameters, stepped as they are).
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
        self.fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[torch.Tensor]] = []
        check_one_master_each([("the optimizer", [  # (an entry each: one master each)
            p for g in self.optimizer.param_groups for p in g["params"]
            if p.requires_grad])], "in FP16_Optimizer")
        # The masters' one owner (peak.optimizers.masters); the groups above are Apex's views.
        self._store = MasterWeights()
        self._store.attach(self, hooks=False)
        # Where each parameter went (kind, index within its kind, per group), to read
        # checkpoints of peak 0.1, whose groups kept the parameters in their original order.
        self._legacy_layout: list[list[tuple[str, int]]] = []
        for group in self.optimizer.param_groups:
            low, masters, fp32, layout = [], [], [], []
            for p in group["params"]:
                if not p.requires_grad:  # frozen: nothing to step (Apex leaves them out too)
                    layout.append(("frozen", -1))
                    # with their state: torch's state_dict() would not find them in a group
                    self.optimizer.state.pop(p, None)
                    continue
                if p.dtype in LOW_DTYPES:
                    layout.append(("master", len(masters)))
                    master = self._store.add(p)
                    if p in self.optimizer.state:
                        self.optimizer.state[master] = self.optimizer.state.pop(p)
                    low.append(p)
                    masters.append(master)
                elif p.dtype == torch.float32:
                    layout.append(("fp32", len(fp32)))
                    fp32.append(p)
                else:
                    raise TypeError(f"FP16_Optimizer wraps float16, bfloat16 and float32 "
                                    f"parameters; got a {p.dtype} parameter")
            group["params"] = masters + fp32  # Apex's order
            self._legacy_layout.append(layout)
            self.fp16_groups.append(low)
            self.fp32_from_fp16_groups.append(masters)
            self.fp32_from_fp32_groups.append(fp32)
        if not self.model_params:
            raise ValueError("FP16_Optimizer found no float16/bfloat16 parameters in the "
                             "optimizer: convert the model with .half() first, or better, use "
                             "peak.amp.initialize(opt_level='O2') which does it for you")
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        args = dict(init_scale=2.0 ** 16, scale_factor=2.0, scale_window=2000,
                    min_loss_scale=None, max_loss_scale=2.0 ** 24)
        if dynamic_loss_args is not None:
            if unknown := set(dynamic_loss_args) - set(args):
                raise ValueError(f"dynamic_loss_args: unknown keys {sorted(unknown)}; valid: "
                                 f"{sorted(args)}")
            args.update(dynamic_loss_args)
        max_scale = float(args["max_loss_scale"] or math.inf)
        init = (min(float(args["init_scale"]), max_scale) if self.dynamic_loss_scale
                else float(static_loss_scale))
        scale_factor = float(args["scale_factor"])
        self._core = LossScale(init, growth_factor=scale_factor, backoff_factor=1.0 / scale_factor,
                               growth_interval=int(args["scale_window"]),
                               min_scale=float(args["min_loss_scale"] or 0.0), max_scale=max_scale,
                               device=self.model_params[0].device)
        self.overflow = False
        self.first_closure_call_this_step = True
        # fp32 gradients are unscaled in place: a later backward of the same step sets them aside
        # (unscaled again, they would be divided twice) and adds them back once it is unscaled.
        self._fp32_unscaled = False
        self._fp32_set_aside: list | None = None

    @property
    def model_params(self) -> list[torch.Tensor]:
        return self._store.model_params

    @property
    def master_params(self) -> list[torch.Tensor]:
        return self._store.masters

    def __getstate__(self):
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state):
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    @property
    def loss_scale(self) -> float:
        return self._core.scale.item()

    @loss_scale.setter
    def loss_scale(self, value) -> None:
        # Apex sets the scaler's current scale (e.g. to schedule a static scale).
        value = float(value)
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"loss_scale must be a finite positive number, got {value}")
        self._core.scale.fill_(value)

    def backward(self, loss, update_master_grads=True, retain_graph=False):
        """``(loss.float() * loss_scale).backward()``, then (by default) unscale into the
        masters' gradients."""
        if loss.numel() != 1:
            raise ValueError(f"backward() needs a scalar loss, got shape {tuple(loss.shape)}")
        fp32 = [p for g in self.fp32_from_fp32_groups for p in g if p.grad is not None]
        if self._fp32_unscaled and fp32 and self._fp32_set_aside is None:
            self._fp32_set_aside = [(p, own_grad(p.grad)) for p in fp32]
            for p in fp32:
                p.grad = None
        # (a pass that raises leaves its partial gradients, as torch's; the set-aside ones are
        # added back at the next update_master_grads, once those are unscaled too)
        (loss.float() * self._core.scale).backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self):
        """Unscale every gradient the optimizer will step (fp16/bf16 ones into the masters'
        ``.grad``, fp32 ones in place), checked for inf/NaN in one pass per (device, dtype)."""
        if not self._fp32_unscaled:  # (a later backward of the step: earlier overflows stand)
            self._core.found_inf.zero_()
        self._store.follow_weights()
        ins, outs = [], []
        for p, m in zip(self.model_params, self.master_params):
            if p.grad is None or p.grad.is_sparse:  # (nn.Embedding(sparse=True): a sparse one)
                m.grad = None if p.grad is None else unscaled_sparse(
                    p.grad, None, self._core.unscale_, m.dtype)
                continue
            if m.grad is None:
                m.grad = torch.empty_like(m)
            ins.append(p.grad)
            outs.append(m.grad)
        for p in (p for g in self.fp32_from_fp32_groups for p in g if p.grad is not None):
            if p.grad.is_sparse:
                p.grad = unscaled_sparse(p.grad, None, self._core.unscale_, p.dtype)
            else:
                ins.append(p.grad)
                outs.append(p.grad)
        self._core.unscale_(ins, outputs=outs)
        for p, g in self._fp32_set_aside or ():
            p.grad = g if p.grad is None else p.grad.add_(g)
        self._fp32_set_aside = None
        self._fp32_unscaled = True
        self.overflow = self.dynamic_loss_scale and self._core.found_inf.any_()

    def inspect_master_grad_data(self):
        """The masters' fp32 gradients, one list per parameter group (None while in an overflow
        state: the gradients are then invalid)."""
        if self.overflow:
            warnings.warn("inspect_master_grad_data: the last gradients overflowed; they are "
                          "invalid (inf, NaN or stale). Returning None.", stacklevel=2)
            return None
        return [[None if m.grad is None else m.grad.data for m in group]
                for group in self.fp32_from_fp16_groups]

    def clip_master_grads(self, max_norm, norm_type=2):
        """Clip the gradients of every fp32 weight the optimizer steps (masters and fp32
        parameters) by their total norm; returns that norm, or -1 on overflow (Apex)."""
        if self.overflow:
            return -1
        fp32 = [p for g in self.optimizer.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(fp32, max_norm, norm_type).item()

    def step(self, closure=None):
        """Skip on overflow (backing the scale off), else step the masters and copy them into
        the model. A closure (static loss scale only, as Apex) must call ``zero_grad()`` and
        ``backward(loss)`` on this object and return the loss."""
        if closure is not None and self.dynamic_loss_scale:
            raise TypeError("Using step with a closure is currently not compatible with dynamic "
                            "loss scaling: use a static_loss_scale, or call backward(loss) and "
                            "then step() without a closure.")
        if self._fp32_set_aside is not None:  # (a backward since the last update raised)
            self.update_master_grads()
        self._fp32_unscaled = False
        if self.overflow:
            self._update_scale()
            if self.verbose:
                print(f"Gradient overflow.  Skipping step, reducing loss scale to "
                      f"{self.loss_scale}")
            return None
        self._store.follow_weights()
        if closure is None:
            result = self.optimizer.step()
        else:
            def wrapped_closure():
                # The optimizer may call the closure more than once (LBFGS): from the second call
                # on, the masters moved, so the model must see them before the next forward.
                if self.first_closure_call_this_step:
                    self.first_closure_call_this_step = False
                else:
                    self._store.copy_to_model()
                return closure()

            try:
                result = self.optimizer.step(wrapped_closure)
            finally:
                self.first_closure_call_this_step = True
        self._store.copy_to_model()
        self._update_scale()
        return result

    def _update_scale(self):
        if self.dynamic_loss_scale:
            self._core.update()

    def zero_grad(self, set_grads_to_None=False):
        for p, g in self._fp32_set_aside or ():  # (zeroed below as the others, or dropped)
            if p.grad is None:
                p.grad = g
        self._fp32_unscaled, self._fp32_set_aside = False, None
        for p in self.model_params + self.master_params + sum(self.fp32_from_fp32_groups, []):
            if set_grads_to_None:
                p.grad = None
            elif p.grad is not None:
                zero_in_place(p.grad)

    def state_dict(self):
        return {
            "loss_scaler": {"loss_scale": self.loss_scale,
                            "growth_tracker": int(self._core.growth_tracker.item())},
            "dynamic_loss_scale": self.dynamic_loss_scale, "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            # One list per parameter group, as Apex.
            "fp32_from_fp16": [[m.detach().clone() for m in g] for g in self.fp32_from_fp16_groups],
        }

    def _from_legacy(self, state_dict):
        """A peak 0.1 checkpoint: 'fp32_from_fp16' a flat list, and the wrapped optimizer's
        state in the original parameter order (frozen parameters included). Returns the masters
        per group and the optimizer state dict renumbered to Apex's order."""
        flat = list(state_dict["fp32_from_fp16"])
        opt_sd = state_dict["optimizer_state_dict"]
        old_sizes = [len(g["params"]) for g in opt_sd["param_groups"]]
        sizes = [len(layout) for layout in self._legacy_layout]
        if old_sizes != sizes:
            raise ValueError(f"checkpoint (written by peak 0.1) has parameter groups of sizes "
                             f"{old_sizes}, this optimizer was built on groups of sizes {sizes}: "
                             f"not the same model and optimizer")
        saved, renumber, new_groups, start = [], {}, [], 0
        for layout, old_group, masters in zip(self._legacy_layout, opt_sd["param_groups"],
                                              self.fp32_from_fp16_groups):
            n_masters = len(masters)
            saved.append(flat[:n_masters])
            flat = flat[n_masters:]
            for (kind, index), old_id in zip(layout, old_group["params"]):
                if kind != "frozen":
                    renumber[old_id] = start + (index if kind == "master" else n_masters + index)
            size = sum(kind != "frozen" for kind, _ in layout)
            new_groups.append(dict(old_group, params=list(range(start, start + size))))
            start += size
        state = {renumber[k]: v for k, v in opt_sd["state"].items() if k in renumber}
        return saved, {"state": state, "param_groups": new_groups}

    def load_state_dict(self, state_dict):
        saved = state_dict["fp32_from_fp16"]
        opt_sd = state_dict["optimizer_state_dict"]
        if saved and isinstance(saved[0], torch.Tensor):  # peak 0.1's layout
            saved, opt_sd = self._from_legacy(state_dict)
        shapes = [len(g) for g in saved]
        mine = [len(g) for g in self.fp32_from_fp16_groups]
        if shapes != mine:
            raise ValueError(f"checkpoint has fp32 master weights for groups of sizes {shapes}, "
                             f"this optimizer has {mine}: not the same model and optimizer")
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self._core.scale.fill_(state_dict["loss_scaler"]["loss_scale"])
        self._core.growth_tracker.fill_(state_dict["loss_scaler"].get("growth_tracker", 0))
        self.overflow = state_dict["overflow"]
        self.first_closure_call_this_step = state_dict["first_closure_call_this_step"]
        self.optimizer.load_state_dict(opt_sd)
        with torch.no_grad():
            for group, saved_group in zip(self.fp32_from_fp16_groups, saved):
                for m, s in zip(group, saved_group):
                    m.copy_(s)

    # Apex exposes the wrapped optimizer's param_groups and state, both settable.
    param_groups = core_attribute("param_groups", "optimizer")
    state = core_attribute("state", "optimizer")
