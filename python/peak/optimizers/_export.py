"""Exports in fp32: the model's weights from the optimizer's exact masters, and the optimizer's
state with fp32 masters and moments (remainders rebuilt, bf16 widened, 8-bit codes decoded)."""
from __future__ import annotations

import torch
from torch import Tensor

from ._checkpoint_check import MOMENT_KEYS, SCALE_KEYS
from ._master_loads import take_fp32_masters
from ._quant import dequantize, scale_key
from .masters import REMAINDER_KEY, join_remainder, masters_by_param


def export_fp32_state_dict(model: torch.nn.Module, optimizer) -> dict:
    """``model.state_dict()`` in fp32, taking each parameter's value from the optimizer's master
    copy where it keeps one (exact fp32 weights, not the rounded model copy): a peak fused
    optimizer, an optimizer that ``amp.initialize`` gave master weights (O2), or
    ``FP16_Optimizer``. Tied parameters get the master under every name they have."""
    take_fp32_masters(optimizer)  # (fp32 weights a load left to the next state read)
    masters = masters_by_param(optimizer)
    by_name = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name, value in model.state_dict(keep_vars=True).items():
        p = by_name.get(name)
        if p is not None and id(p) in masters:
            out[name] = masters[id(p)].detach().clone()
        elif value.is_floating_point():
            out[name] = value.detach().to(torch.float32, copy=True)
        else:
            out[name] = value.detach().clone()
    return out


def export_fp32_optimizer_state_dict(optimizer) -> dict:
    """``optimizer.state_dict()`` with every lean part in fp32: ``master_param`` rebuilt exactly
    from ``master_param_remainder`` (and the parameter's current bf16 value), bf16 moments
    widened exactly, 8-bit moments decoded exactly (their ``*_scale`` entries dropped). It loads
    into a peak optimizer with fp32 state or into ``torch.optim.AdamW``."""
    sd = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in sd["param_groups"] for i in g["params"]]
    by_id = dict(zip(ids, params))
    state = {}
    for pid, st in sd["state"].items():
        st = dict(st)
        for key in MOMENT_KEYS:
            value = st.get(key)
            if not isinstance(value, Tensor):
                continue
            if value.dtype == torch.uint8:
                st[key] = dequantize(value, st[scale_key(key)], key)
            else:
                st[key] = value.to(torch.float32, copy=True)
        for key in SCALE_KEYS:
            st.pop(key, None)
        remainder = st.pop(REMAINDER_KEY, None)
        if remainder is not None and pid in by_id:
            st["master_param"] = join_remainder(by_id[pid].detach(), remainder)
        state[pid] = st
    groups = []
    for group in sd["param_groups"]:
        group = dict(group)
        for key in ("exp_avg_dtype", "exp_avg_sq_dtype", "momentum_dtype"):
            if key in group:
                group[key] = torch.float32
        group["store_param_remainders"] = False
        groups.append(group)
    return {"state": state, "param_groups": groups}
