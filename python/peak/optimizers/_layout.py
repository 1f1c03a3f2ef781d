"""A parameter's memory layout and its optimizer state's: the kernels walk a parameter, its
gradient and its state as one block of memory, in the same order (and what they cannot step is
refused before a step starts). And the state's storage, which follows its group's options."""
from __future__ import annotations

import torch
from torch import Tensor

from ._arguments import LEAN_KEYS, check_group, check_storage
from ._checkpoint_check import MOMENT_KEYS
from ._memory_layout import dense, follow_layout
from ._quant import load_moment, scale_key
from ._sharded import is_sharded
from ._master_loads import load_master
from ._followed import follow_weight
from .masters import MASTER_KEY, REMAINDER_KEY, join_remainder

_STORAGE_OPTIONS = LEAN_KEYS + ("amsgrad",)  # (amsgrad keeps a moment more, in fp32)


def check_steppable(optimizer) -> None:
    """Before any group steps (a step refused half-way would have stepped the groups before,
    and a retry would step them twice): what the kernels cannot step is refused here."""
    name, sums = type(optimizer).__name__, optimizer.__dict__.get("_fp32_grad_sums") or {}
    for group in optimizer.param_groups:  # (per parameter only what is cheap: this runs per step)
        if group.get("maximize") and "maximize" not in optimizer.defaults:  # (set by hand)
            raise ValueError(f"{name} does not take maximize=True (a param group has it; the "
                             "constructor has no such option): it would minimize; remove it, "
                             "negate the loss, or use the torch optimizer")
        for torch_key, key in getattr(optimizer, "_torch_synonyms", {}).items():  # (by hand)
            if torch_key in group and bool(group[torch_key]) != bool(group[key]):
                raise ValueError(f"{name}: a param group has {torch_key}={group[torch_key]} but "
                                 f"{key}={group[key]} (torch's name and peak's): set both alike")
        remainders = group.get("store_param_remainders", False)
        rounding = group.get("stochastic_rounding", False)
        for p in group["params"]:
            grad, dtype = p.grad, p.dtype
            if grad is None:
                if p not in sums:
                    continue
                grad = p  # (a sum: in p's dtype)
            if grad.is_sparse:
                raise RuntimeError(f"{name} does not support sparse gradients (nn.Embedding("
                                   f"sparse=True)): step those parameters with a torch optimizer "
                                   f"that does (SGD, SparseAdam), or make them dense")
            if grad.dtype != dtype:
                raise TypeError(f"a gradient has dtype {grad.dtype} but its parameter has "
                                f"{dtype}; {name} reads gradients in the parameter's dtype")
            if dtype not in _STEPPED_DTYPES:
                optimizer.wants_master(p)  # (raises, naming the dtypes the kernels step)
            if remainders and dtype != torch.bfloat16:
                optimizer.keeps_remainder(p, group)  # (raises for an fp16 parameter)
            if not (p.is_contiguous() or dense(p)):
                raise RuntimeError(
                    f"{name}: a parameter of shape {tuple(p.shape)} is not dense (strides "
                    f"{p.stride()}); the kernels walk a parameter's memory as one block: make "
                    "it contiguous before building the optimizer (p.data = p.data.contiguous())")
            if rounding and dtype == torch.float16:
                raise TypeError(
                    f"{name}(stochastic_rounding=True) rounds bfloat16 weights; this group "
                    "has a float16 parameter. Keep fp32 master weights for fp16 models "
                    "(master_weights=None), or use bfloat16")


_STEPPED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class LayoutWatch:
    """Whose state layouts a step checks (``follow_layout``): every parameter's at the first step,
    after a load and after a step with a strided parameter; else strided parameters' and those
    that sat out such a step without a gradient (a cheap test per parameter and step)."""

    def __init__(self) -> None:
        self.check_all, self.strided, self.pending = True, False, set()

    def sat_out(self, p: Tensor, state: dict) -> None:
        if self.check_all and p in state:
            self.pending.add(id(p))

    def visit(self, p: Tensor, state: dict) -> None:
        if self.check_all or not p.is_contiguous() or (self.pending and id(p) in self.pending):
            self.strided |= follow_layout(p, state)
            self.pending.discard(id(p))

    def step_done(self) -> None:
        self.check_all, self.strided = self.strided, False


def _storage(group: dict) -> tuple:
    return tuple(group.get(k) for k in _STORAGE_OPTIONS)


def note_storage(optimizer, groups: list | None = None) -> None:
    """The storage options ``groups``' state is kept in (a group added; all of them: a load)."""
    seen = [] if groups is None else optimizer.__dict__.get("_storage_seen", [])
    optimizer._storage_seen = seen + [(group, _storage(group))
                                      for group in (groups or optimizer.param_groups)]


def storage_changes(optimizer) -> list:
    """Before a step: the groups whose storage options were set on them since their state was
    made (``group["exp_avg_dtype"] = "bf16"``, ``store_param_remainders``, ``amsgrad``), each
    checked as the constructor checks its options before anything changes (``follow_storage``
    then converts their state)."""
    seen = {id(group): (group, options)
            for group, options in optimizer.__dict__.get("_storage_seen", ())}
    changed, name = [], type(optimizer).__name__
    for group in optimizer.param_groups:
        was, options = seen.get(id(group), (None, None))
        if was is not group or options == _storage(group):
            continue
        changed.append(group)
        check_group(group, optimizer.defaults)
        group.update(check_storage(name, group, optimizer.defaults, optimizer.master_weights))
        for p in (p for p in group["params"] if optimizer.state.get(p)):
            state = optimizer.state[p]
            remainder = optimizer.keeps_remainder(p, group)  # (raises for an fp16 parameter)
            if remainder and getattr(state.get(MASTER_KEY), "grad", None) is not None:
                raise RuntimeError(f"{name}: store_param_remainders set on a param group between "
                                   "give_master_grads() and step(); set it before or after")
            if is_sharded(p) and any((state[k].dtype == torch.uint8)
                                     != (optimizer._state_dtype(group, k, p) == torch.uint8)
                                     for k in MOMENT_KEYS if k in state):
                raise NotImplementedError(
                    f"{name}: a param group's moments set to or from 8-bit mid-run on sharded "
                    "(DTensor) parameters; convert the storage in one process (save, build the "
                    "optimizer with the new options, load)")
    return changed


def follow_storage(optimizer, changed: list) -> None:
    """The state of the ``changed`` groups (``storage_changes``) in their new storage, converted
    as a load converts a checkpoint's; the watch keeps the optimizer's current groups."""
    for group in changed:
        for p in (p for p in group["params"] if optimizer.state.get(p)):
            state = optimizer.state[p]
            for key in [k for k in MOMENT_KEYS if k in state]:
                load_moment(state, key, state[key], state.get(scale_key(key)),
                            optimizer._state_dtype(group, key, p), p)
            if (REMAINDER_KEY in state) != optimizer.keeps_remainder(p, group):
                follow_weight(optimizer, p, state)  # (a weight loaded since the last step wins)
                master = state.get(MASTER_KEY)
                if master is None:
                    master = join_remainder(p.detach(), state[REMAINDER_KEY])
                load_master(optimizer, p, state, group, {MASTER_KEY: master})
    seen = optimizer.__dict__.get("_storage_seen", ())
    if changed or len(seen) != len(optimizer.param_groups) or any(
            a is not b for a, (b, _) in zip(optimizer.param_groups, seen)):
        note_storage(optimizer)
