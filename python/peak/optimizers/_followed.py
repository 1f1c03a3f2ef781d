"""A fused optimizer's watch over its weights (NOTE: [Masters after a model reload] in masters.py):
each weight's version when its master last matched it, followed at the next step where written
since, and what an optimizer load left for weights arriving after it.

NOTE: [No weak references to parameters] ``torch.utils.swap_tensors`` refuses a tensor that has
a Python weak reference, and ``module.to()``, ``cpu()``, ``half()`` swap parameters and their
gradients in place whenever a parameter is a tensor subclass (FSDP2's DTensors) or
``torch.__future__.set_swap_module_params_on_conversion(True)`` is set. So peak's bookkeeping
keyed by parameter is held by the object that holds those parameters anyway (here the fused
optimizer; a store; amp's optimizer state), keyed by ``id(p)`` beside a strong reference to p,
which keeps the id p's for as long as the entry lives and dies with its holder."""
from __future__ import annotations

import torch
from torch import Tensor

from ..scaling import local_shard
from ._memory_layout import UNSEEN, weight_checksum, weight_stamp, written_since
from ._remainders import MASTER_KEY, REMAINDER_KEY, join_or_weight, keep_as_remainder, weight_wins


class FollowedWeights:
    """One fused optimizer's entries, each ``id(p) -> (p, ...)``."""

    def __init__(self) -> None:
        # p's stamp when its master last matched it, and the checksum of its bits after the last
        # step if it is watched (a remainder-kept weight written outside the step once), else None
        self.versions: dict[int, tuple] = {}
        self.watched: set[int] = set()
        self.awaiting: dict[int, Tensor] = {}  # a remainder loaded before its weight
        # the remainder an fp32 master was joined from at an optimizer load, to join again with a
        # weight loaded after it (until the next step)
        self.joins: dict[int, tuple] = {}
        # the fp32 master an optimizer load split into a remainder (the weight its rounding, ties
        # away), to split again from a weight loaded after it, rounded to nearest even: the master
        # where it rounds to that weight (until the next step)
        self.splits: dict[int, tuple] = {}
        self.amp_owned: dict[int, Tensor] = {}  # amp O2's parameters (masters.register_owner)


def followed(optimizer) -> FollowedWeights:
    """``optimizer``'s entries (not kept through pickling or deepcopy: a copy starts afresh)."""
    table = optimizer.__dict__.get("_followed")
    if table is None:
        table = optimizer.__dict__["_followed"] = FollowedWeights()
    return table


def note_weight(optimizer, p: Tensor, checksum: Tensor | None = None,
                unseen: bool = False) -> None:
    """p's master matches its weight now (``unseen``: compared element by element at its step)."""
    followed(optimizer).versions[id(p)] = (p, UNSEEN if unseen else weight_stamp(p), checksum)


def _noted(table: FollowedWeights, p: Tensor) -> None:  # (note_weight, the table at hand)
    table.versions[id(p)] = (p, weight_stamp(p), None)


def forget_weight(optimizer, p: Tensor) -> None:
    table = followed(optimizer)
    table.versions.pop(id(p), None)
    table.watched.discard(id(p))


def note_master_made(optimizer, p: Tensor, state: dict) -> None:
    """A master just made from p's fp32 weights (amp O2): the first step compares the two element
    by element, so that a write before that step, even through ``.data``, is followed, as Apex
    made its masters at the first ``scale_loss``. (A remainder follows any weight it is joined
    with.)"""
    note_weight(optimizer, p, unseen=MASTER_KEY in state)


def follow_weight(optimizer, p: Tensor, state: dict) -> None:
    """Before p is stepped: its master follows a weight written since the last step; no host
    sync."""
    table = followed(optimizer)
    entry = table.versions.get(id(p))
    remainder = table.joins.pop(id(p), (None, None))[1] if table.joins else None
    split = table.splits.pop(id(p), (None, None))[1] if table.splits else None
    if entry is None:  # first seen: the weight is where the master is
        return _noted(table, p)
    if not written_since(p, entry[1], MASTER_KEY in state):  # (a remainder joins any weight)
        return None
    if not (p.is_cuda and torch.cuda.is_current_stream_capturing()):  # (a replay would repeat)
        with torch.no_grad():
            if remainder is not None and MASTER_KEY in state:  # the weight saved with it arrived
                local_shard(state[MASTER_KEY]).copy_(
                    join_or_weight(local_shard(p), local_shard(remainder)))
            elif split is not None and REMAINDER_KEY in state:  # so did the master's weight
                keep_as_remainder(p, state, weight_wins(split, p))
            else:
                follow_write(table, p, state, entry)
    return _noted(table, p)


def follow_write(table: FollowedWeights, p: Tensor, state: dict, entry: tuple) -> None:
    """p's master (or remainder) in ``state`` follows a weight written since ``entry``'s step."""
    if REMAINDER_KEY in state:  # (each rank: its shard's bits; kept if watched and unchanged)
        same = entry[2] is not None and weight_checksum(p) == entry[2]
        local_shard(state[REMAINDER_KEY]).mul_(same)
        table.watched.add(id(p))
    elif MASTER_KEY in state:
        state[MASTER_KEY].copy_(weight_wins(state[MASTER_KEY], p))


def as_followed(optimizer, p: Tensor, state: dict) -> dict:
    """``state``, or a copy whose master (or remainder) follows a weight written since the last
    step as that step will: what reads between steps give (a save, ``master_of``, the exports).
    The live state waits for the step, so a read changes no training."""
    table = followed(optimizer)
    entry, key = table.versions.get(id(p)), REMAINDER_KEY if REMAINDER_KEY in state else MASTER_KEY
    if key not in state or entry is None or not written_since(p, entry[1], key == MASTER_KEY):
        return state
    state = {**state, key: state[key].clone()}
    with torch.no_grad():
        follow_write(table, p, state, entry)
    return state


def settle_loads(optimizer, params=None) -> None:
    """Before a fused optimizer's masters are read (``state_dict``, ``master_of``, the exports):
    a join or split an optimizer load left for a weight written since is made now, as the next
    step would make it."""
    table = followed(optimizer)
    if not (table.joins or table.splits):
        return
    for p in params or [p for group in optimizer.param_groups for p in group["params"]]:
        entry, state = table.versions.get(id(p)), optimizer.state.get(p)
        if ((id(p) in table.joins or id(p) in table.splits) and entry is not None and state
                and written_since(p, entry[1])):
            follow_weight(optimizer, p, state)


def note_stepped(optimizer, params: list[Tensor]) -> None:
    """After the step wrote ``params``: the checksums of the watched ones."""
    table = followed(optimizer)
    if table.watched:
        for p in params:
            if id(p) in table.watched:
                note_weight(optimizer, p, weight_checksum(p))


def weights_settled(optimizer) -> None:
    """A step: remainders loaded before their weights wait no longer (the step starts from them)."""
    followed(optimizer).awaiting.clear()
