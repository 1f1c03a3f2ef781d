"""A fused optimizer's save and load of master weights: masters saved with the weights written
since the last step (``masters_to_save``); a saved master (fp32 or a remainder) into the
loading optimizer's form, the masters it had kept where the checkpoint has none, what the
weights arriving with or after the load are checked against (NOTE: [Masters after a model
reload] in masters.py), and fp32 parameters' weights from a low-precision run's masters."""
from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from ..scaling import local_shard
from ._memory_layout import written_since
from ._sharded import is_sharded
from ._followed import as_followed, followed, forget_weight, note_weight
from .masters import (MASTER_KEY, REMAINDER_KEY, copy_to_model, join_or_weight, join_remainder,
                      keep_as_remainder, weight_wins)

_fp32_pending = WeakIdKeyDictionary()  # fused optimizer -> {fp32 param: a loaded master}


def masters_to_save(optimizer, packed: dict) -> None:
    """NOTE: [Masters saved after a write] In ``packed`` (a state_dict's "state"), a master or
    remainder that a weight written since the last step left behind is saved as that step will
    follow it: the checkpoint's weights and masters go together, so either load order resumes
    exactly (``as_followed``: saving changes no training)."""
    for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        if i in packed:
            packed[i] = as_followed(optimizer, p, packed[i])


def load_master(optimizer, p: Tensor, state: dict, group: dict, entries: dict,
                via_torch: bool = False) -> Tensor | None:
    """A saved master (``entries``: p's checkpoint state) into ``optimizer``'s form: a remainder
    as is, or joined with p's current bf16 value, which must be the weight saved with it (load the
    model's state_dict too); an fp32 master as is, or split into p's rounding and a remainder, or
    (an fp32 p, saved from a low-precision run) into p where p is its rounding. A checkpoint a
    torch optimizer wrote (``via_torch``) may hold stale masters: split, the weight wins where one
    does not round to it; a remainder torch's load cast to p's dtype (its bits lost) is dropped.
    Returns the remainder an fp32 master was joined from, if so (for ``weight_loaded``)."""
    state.pop(MASTER_KEY, None)
    state.pop(REMAINDER_KEY, None)
    master, remainder = entries.get(MASTER_KEY), entries.get(REMAINDER_KEY)
    if via_torch and remainder is not None and remainder.dtype != torch.int16:
        remainder = None
    if remainder is not None:
        remainder = remainder.to(device=p.device, dtype=torch.int16)
        if optimizer.keeps_remainder(p, group):
            state[REMAINDER_KEY] = remainder.clone()
            followed(optimizer).awaiting[id(p)] = p  # (its weight comes with the model's)
            return None
        master = join_or_weight(p.detach(), remainder)
    if master is None:
        return None  # the optimizer starts it from the weights
    if optimizer.keeps_remainder(p, group):
        keep_as_remainder(p, state, weight_wins(master.to(p.device, torch.float32), p)
                          if via_torch else master)
        note_weight(optimizer, p)
        # (a weight arriving later is split again: ``follow_weight``)
        followed(optimizer).splits[id(p)] = (p, master.detach().to(p.device, torch.float32,
                                                                    copy=True))
    elif optimizer.wants_master(p):
        # (detached: amp O2's torch-optimizer layout saves the master as a Parameter)
        state[MASTER_KEY] = master.detach().to(device=p.device, dtype=torch.float32, copy=True)
        return remainder  # (joined with the weight now; again with one loaded after it)
    elif p.dtype == torch.float32 and not is_sharded(p):  # (from a bf16/fp16 run: NOTE: [fp32
        # weights from masters], below)
        _fp32_pending.setdefault(optimizer, {})[p] = master.detach().to(p.device, torch.float32)
    return None


def weight_loaded(optimizer, p: Tensor, joined_remainder: Tensor | None, check: bool,
                  master: bool) -> None:
    """After an optimizer load: with ``check`` p's fp32 master is checked against its weight at
    the next step (the weight wins where the master does not round to it: a torch optimizer's
    stale master); a master joined from a remainder is joined again with a weight written after
    the load; another fp32 ``master`` follows a weight written after the load (a model loaded
    after it brings the weights it rounds to); else p's weight is taken to go with its loaded
    remainder (its version is forgotten). An earlier load's pending join is dropped."""
    table = followed(optimizer)
    table.joins.pop(id(p), None)
    if joined_remainder is not None:
        table.joins[id(p)] = (p, joined_remainder)
    if master or joined_remainder is not None or id(p) in table.splits:  # (check: a master)
        note_weight(optimizer, p, unseen=check)
    else:
        forget_weight(optimizer, p)


def masters_before_load(optimizer) -> dict:
    """p -> its master before a fused optimizer's load, kept where the checkpoint has none for p
    (torch's or Apex's): an fp32 master, or a remainder while its weight is the one it goes with
    (``kept_master`` makes the master)."""
    kept = {}
    _fp32_pending.pop(optimizer, None)  # (an earlier load's)
    table = followed(optimizer)
    for p in (p for group in optimizer.param_groups for p in group["params"]):
        table.splits.pop(id(p), None)  # (an earlier load's)
        st, entry = optimizer.state.get(p, {}), table.versions.get(id(p))
        t = st.get(MASTER_KEY, st.get(REMAINDER_KEY))
        if t is None or t.shape != p.shape or t.device != p.device or is_sharded(p):
            continue
        if t.dtype == torch.float32 or (p.dtype == torch.bfloat16 and (  # (a remainder joins any)
                entry is None or not written_since(p, entry[1], storage=False))):
            kept[p] = t
    return kept


def kept_master(p: Tensor, kept: Tensor) -> Tensor:
    """The fp32 master ``kept`` stands for: a remainder joined with p's weight, or an fp32 master
    where it rounds to the weight and the weight where not (a weight written since it was)."""
    return join_remainder(p.detach(), kept) if kept.dtype == torch.int16 else weight_wins(kept, p)


def masters_loaded(optimizer, joined: dict, kept: dict, via_torch: bool) -> None:
    """After a fused optimizer's load (``joined``: parameter -> the remainder its fp32 master was
    joined from): the loaded fp32 masters refresh the model, as a store's do (a weight written
    after the load wins). A checkpoint a torch optimizer wrote (``via_torch``: its options in the
    groups) may hold stale masters (torch keeps an unknown 'master_param' as it was while it trains
    the weights): those are checked against the weights at the next step instead, and follow them
    where they do not round to them. Masters ``kept`` from before the load go with the weights
    already."""
    refresh = ([], [])
    for group in optimizer.param_groups:
        for p in group["params"]:
            master = optimizer.state.get(p, {}).get(MASTER_KEY)
            check = master is not None and via_torch and p not in kept
            weight_loaded(optimizer, p, joined.get(p), check, master is not None)
            if p in kept:  # (it goes with this weight: a weight written after the load wins)
                note_weight(optimizer, p)
            if master is not None and not via_torch and joined.get(p) is None and p not in kept:
                refresh[0].append(local_shard(master))
                refresh[1].append(local_shard(p))
    copy_to_model(*refresh)
    take_fp32_masters(optimizer, at_load=True)


def take_fp32_masters(optimizer, at_load: bool = False) -> None:
    """NOTE: [fp32 weights from masters] A low-precision run's masters loaded for fp32 parameters
    become their weights if each one is, whole, its weight's bf16 or fp16 rounding: the model
    saved with them, loaded before the optimizer (decided at the load) or after it (at the next
    step or state read, on the device); else none does (another run's weights, or a torch
    optimizer's training since, which left the saved masters stale)."""
    pending = _fp32_pending.get(optimizer)
    if not pending:
        return
    device = next(iter(pending)).device
    ok = torch.stack([((m.to(torch.bfloat16).float() == p).all()
                       | (m.to(torch.float16).float() == p).all()).to(device)
                      for p, m in pending.items()]).all()
    if at_load and not bool(ok):
        return  # (a model loaded after the optimizer: decided again)
    del _fp32_pending[optimizer]
    with torch.no_grad():
        for p, m in pending.items():
            p.copy_(torch.where(ok.to(p.device), m, p))
