"""``FP16_Optimizer``: Apex's deprecated wrapper, kept so that old scripts run (docs/migrating.md,
"From FP16_Optimizer")."""
from __future__ import annotations

import math
import warnings

import torch

from ..optimizers.masters import (LOW_DTYPES, MasterWeights, check_one_master_each, own_grad,
                                  state_for_master, unscaled_sparse, zero_in_place)
from ..scaling import LossScale, check_scale, core_attribute
from .fp16util import clip_grad_norm


# Optimizer state keys shaped as their parameter (torch's and peak's optimizers).
_PER_ELEMENT = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "sum")


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
                      "opt_level='O2') and amp.scale_loss (see docs/migrating.md, 'From "
                      "FP16_Optimizer')", DeprecationWarning, stacklevel=2)
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
        # NOTE: [FP16_Optimizer's groups] As Apex's: each fp16/bf16 parameter's master takes its
        # place in its group's list, in place (LBFGS keeps that list), the others stay where they
        # are, frozen ones included (a master when first given a gradient). `_layout`: what each
        # place holds, (kind, index within its kind), to read peak's earlier layouts.
        self._layout: list[list[list]] = []
        self._take_new(lambda p: p.requires_grad)
        if not self.model_params and not any(p.dtype in LOW_DTYPES for g in self.param_groups
                                             for p in g["params"]):
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
        check_scale("FP16_Optimizer: the initial loss scale", init)
        scale_factor = float(args["scale_factor"])
        self._core = LossScale(init, growth_factor=scale_factor, backoff_factor=1.0 / scale_factor,
                               growth_interval=int(args["scale_window"]),
                               min_scale=float(args["min_loss_scale"] or 0.0), max_scale=max_scale,
                               device=next(p.device for g in self.param_groups
                                           for p in g["params"]))
        self.overflow = False
        self.first_closure_call_this_step = True
        # fp32 gradients are unscaled in place: a later backward of the same step sets them aside
        # (unscaled again, they would be divided twice) and adds them back once it is unscaled.
        self._fp32_unscaled = False
        self._fp32_set_aside: list | None = None

    def _take_new(self, wanted) -> None:
        """The places not stepped yet (groups added since included) that ``wanted`` picks:
        trainable ones at construction, ones with a gradient later (unfrozen, or in a group added
        to the wrapped optimizer)."""
        for g, group in enumerate(self.optimizer.param_groups):
            if g == len(self._layout):
                self._layout.append([["frozen", -1] for _ in group["params"]])
                for lists in (self.fp16_groups, self.fp32_from_fp16_groups,
                              self.fp32_from_fp32_groups):
                    lists.append([])
            for i, (p, entry) in enumerate(zip(group["params"], self._layout[g])):
                if entry[0] == "frozen" and wanted(p):
                    self._take(g, i)

    def _take(self, g: int, i: int) -> None:
        """Place ``i`` of group ``g`` is stepped from now on: a master in place of an fp16/bf16
        parameter (with its state, in fp32), an fp32 one as it is; the kinds' lists keep group
        order."""
        params, layout = self.optimizer.param_groups[g]["params"], self._layout[g]
        p, kind = params[i], "master" if params[i].dtype in LOW_DTYPES else "fp32"
        if p.dtype not in LOW_DTYPES and p.dtype != torch.float32:
            raise TypeError(f"FP16_Optimizer wraps float16, bfloat16 and float32 parameters; got "
                            f"a {p.dtype} parameter (param_groups[{g}][{i}])")
        if kind == "master" and self._store.holds(p):  # (a group added to the wrapped optimizer)
            check_one_master_each([("FP16_Optimizer", [p]), ("a group added since", [p])],
                                  f"param_groups[{g}] of the wrapped optimizer")
        k = sum(entry[0] == kind for entry in layout[:i])
        for entry in layout[i + 1:]:
            entry[1] += entry[0] == kind
        layout[i] = [kind, k]
        if kind == "master":
            params[i] = master = self._store.add(p)
            if p in self.optimizer.state:  # (fp16 moments, e.g. loaded into the fp16 weight)
                self.optimizer.state[master] = state_for_master(self.optimizer.state.pop(p))
            self.fp16_groups[g].insert(k, p)
            self.fp32_from_fp16_groups[g].insert(k, master)
        else:
            self.fp32_from_fp32_groups[g].insert(k, p)

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
        self._core.scale.fill_(check_scale("loss_scale", float(value)))

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
        self._take_new(lambda p: p.grad is not None)  # (unfrozen since, or a group added)
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
        """The fp32 gradients the step reads, one list per parameter group in the group's order
        (masters and fp32 parameters, None where a parameter has none), as Apex's; None while in
        an overflow state (the gradients are then invalid)."""
        if self.overflow:
            warnings.warn("inspect_master_grad_data: the last gradients overflowed; they are "
                          "invalid (inf, NaN or stale). Returning None.", stacklevel=2)
            return None
        return [[None if p.grad is None else p.grad.data for p in group["params"]]
                for group in self.optimizer.param_groups]

    def clip_master_grads(self, max_norm, norm_type=2):
        """Clip the gradients of every fp32 weight the optimizer steps (masters and fp32
        parameters) by their total norm; returns that norm, or -1 on overflow (Apex)."""
        if self.overflow:
            return -1
        fp32 = [p for g in self.optimizer.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(fp32, max_norm, norm_type)  # (a tensor, as Apex's)

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
        for p in self.model_params + [p for g in self.optimizer.param_groups for p in g["params"]]:
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
            # One list per parameter group, as Apex, whose group order the optimizer's state
            # keeps too (NOTE: [FP16_Optimizer's groups]); the key marks it for peak's loader.
            "fp32_from_fp16": [[m.detach().clone() for m in g] for g in self.fp32_from_fp16_groups],
            "groups_in_place": [[kind for kind, _ in layout] for layout in self._layout],
        }

    def _in_place(self, state_dict):
        """The masters per group and the optimizer's state dict, in the groups' own order.
        Earlier peak layouts are read too: 0.1 saved a flat 'fp32_from_fp16' (the order was this
        one); later ones, until the 'groups_in_place' mark, put each group's masters first, then
        its fp32 parameters, and left frozen ones out: renumbered here."""
        saved, opt_sd = state_dict["fp32_from_fp16"], state_dict["optimizer_state_dict"]
        self._take_new(lambda p: False)  # (groups added to the wrapped optimizer since: known)
        if saved and isinstance(saved[0], torch.Tensor):  # peak 0.1
            if len(saved) != len(self.master_params):
                raise ValueError(f"checkpoint (written by peak 0.1) has {len(saved)} fp32 master "
                                 f"weights, this optimizer {len(self.master_params)}: not the "
                                 "same model and optimizer (or parameters frozen differently)")
            flat, saved = list(saved), []
            for group in self.fp32_from_fp16_groups:
                saved.append(flat[:len(group)])
                flat = flat[len(group):]
            return saved, opt_sd
        kinds = state_dict.get("groups_in_place")
        if isinstance(kinds, list):  # places stepped when it was saved are stepped from now on
            for g, group_kinds in enumerate(kinds[:len(self._layout)]):
                for i, kind in enumerate(group_kinds[:len(self._layout[g])]):
                    if kind != "frozen" and self._layout[g][i][0] == "frozen":
                        self._take(g, i)
        if kinds or not isinstance(state_dict["loss_scaler"], dict):
            return saved, opt_sd  # (peak's, or Apex's: its LossScaler object)
        sizes = [len(g["params"]) for g in opt_sd["param_groups"]]
        stepped = [sum(kind != "frozen" for kind, _ in layout) for layout in self._layout]
        if sizes != stepped:
            raise ValueError(f"checkpoint (written by an earlier peak) steps parameter groups of "
                             f"sizes {sizes}, this optimizer {stepped}: not the same model and "
                             "optimizer (or parameters frozen differently)")
        if [len(g) for g in saved] != [len(g) for g in self.fp32_from_fp16_groups]:
            raise ValueError("checkpoint (written by an earlier peak) has fp32 master weights for "
                             f"groups of sizes {[len(g) for g in saved]}, this optimizer "
                             f"{[len(g) for g in self.fp32_from_fp16_groups]}: not the same model")
        renumber, groups, start = {}, [], 0
        for layout, old_group, masters in zip(self._layout, opt_sd["param_groups"], saved):
            for i, (kind, k) in enumerate(layout):
                if kind != "frozen":
                    renumber[old_group["params"][k if kind == "master" else len(masters) + k]] = \
                        start + i
            groups.append(dict(old_group, params=list(range(start, start + len(layout)))))
            start += len(layout)
        state = {renumber[k]: v for k, v in opt_sd["state"].items() if k in renumber}
        return saved, {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        saved, opt_sd = self._in_place(state_dict)
        shapes = [len(g) for g in saved]
        mine = [len(g) for g in self.fp32_from_fp16_groups]
        if shapes != mine:
            raise ValueError(f"checkpoint has fp32 master weights for groups of sizes {shapes}, "
                             f"this optimizer has {mine}: not the same model and optimizer (or "
                             "parameters frozen differently)")
        # A state that fits another place (a layout read wrongly) is refused, not loaded.
        flat = [p for g in self.param_groups for p in g["params"]]
        bad = [i for i, st in opt_sd["state"].items() if isinstance(i, int) and any(
            isinstance(st.get(key), torch.Tensor) and st[key].dim() > 0
            and (i >= len(flat) or st[key].shape != flat[i].shape) for key in _PER_ELEMENT)]
        if bad or any(m.shape != s.shape for g, sg in zip(self.fp32_from_fp16_groups, saved)
                      for m, s in zip(g, sg)):
            raise ValueError(f"checkpoint's optimizer state (parameters {bad}) or masters do not "
                             "fit this optimizer's parameters in shape: not the same model and "
                             "optimizer")
        scaler = state_dict["loss_scaler"]
        if not isinstance(scaler, dict):  # (a LossScaler object: Apex's, unpickled under the
            scaler = {"loss_scale": float(scaler.loss_scale()),  # alias with its window)
                      "growth_tracker": int(getattr(scaler, "growth_tracker", 0))}
        check_scale("FP16_Optimizer.load_state_dict: the checkpoint's loss scale",
                    float(scaler["loss_scale"]))  # (before anything changes)
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self._core.scale.fill_(scaler["loss_scale"])
        self._core.growth_tracker.fill_(scaler.get("growth_tracker", 0))
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
    # Apex's flat views of the groups (lists it built once; here what the groups hold now).
    all_fp16_params = property(lambda self: [p for g in self.fp16_groups for p in g])
    all_fp32_from_fp16_params = property(lambda self: [p for g in self.fp32_from_fp16_groups
                                                       for p in g])
    all_fp32_from_fp32_params = property(lambda self: [p for g in self.fp32_from_fp32_groups
                                                       for p in g])
    clip_grad_norm = staticmethod(clip_grad_norm)  # (Apex's attribute: fp16util's function)
