"""Remainder masters' bits (NOTE: [Remainder masters]): a bf16 weight and the int16 low half
it drops join into the exact fp32 master, and an fp32 master splits into the two."""
from __future__ import annotations

import torch
from torch import Tensor

from ..scaling import local_shard
from ._sharded import is_sharded

MASTER_KEY = "master_param"
REMAINDER_KEY = "master_param_remainder"


def join_remainder(weight: Tensor, remainder: Tensor) -> Tensor:
    """The fp32 master held as a bf16 ``weight`` and its int16 ``remainder`` (the low 16 bits; a
    negative remainder means the weight was rounded up): NOTE: [Remainder masters]."""
    if is_sharded(weight):  # (DTensor's shifts leave a tensor as it is: shard by shard)
        out = torch.empty_like(weight, dtype=torch.float32)
        local_shard(out).copy_(join_remainder(local_shard(weight), local_shard(remainder)))
        return out
    high = weight.view(torch.int16).to(torch.int32) & 0xFFFF
    low = remainder.to(torch.int32) & 0xFFFF
    high = (high - (low >> 15)) & 0xFFFF
    bits = (high.to(torch.int64) << 16) | low.to(torch.int64)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return bits.view(torch.float32)


def join_or_weight(weight: Tensor, remainder: Tensor) -> Tensor:
    """:func:`join_remainder`, but the weight where the join is not finite and the weight is: a
    remainder joined with a weight other than its own (a user's write after a load) can cross
    the exponent's edge (a zero weight and a rounded-up remainder join to NaN bits)."""
    joined = join_remainder(weight, remainder)
    return torch.where(joined.isfinite() | ~weight.isfinite(), joined, weight.float())


def split_master(master: Tensor) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`join_remainder`: (bf16 weight, int16 remainder) with the weight the
    master rounded half away from zero in magnitude (round to nearest, ties up in magnitude)."""
    if is_sharded(master):  # (as join_remainder: shard by shard)
        parts = split_master(local_shard(master))
        out = (torch.empty_like(master, dtype=torch.bfloat16),
               torch.empty_like(master, dtype=torch.int16))
        for whole, part in zip(out, parts):
            local_shard(whole).copy_(part)
        return out
    bits = master.detach().to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    bits = bits & 0xFFFFFFFF
    low = bits & 0xFFFF
    high = ((bits >> 16) + (low >> 15)) & 0xFFFF
    as_int16 = lambda x: torch.where(x >= 2**15, x - 2**16, x).to(torch.int16)  # noqa: E731
    return as_int16(high).view(torch.bfloat16), as_int16(low)


def keep_as_remainder(p: Tensor, state: dict, master: Tensor) -> None:
    """Keep an fp32 ``master`` as p's remainder, p its rounding (NOTE: [Remainder masters]). The
    weight changes: its optimizer notes it again (``_followed.note_weight``)."""
    weight, remainder = split_master(master.to(p.device))
    with torch.no_grad():
        p.copy_(weight.view(p.shape))
    state[REMAINDER_KEY] = torch.empty_like(p, dtype=torch.int16).copy_(
        remainder.view(p.shape))


def _rounds(master: Tensor, p: Tensor) -> Tensor:
    """Where ``master`` rounds to p's weight: to nearest even (torch's cast) or, for bf16, ties
    away from zero (a remainder's weight: a tie's two roundings are both the master's)."""
    near = master.to(p.dtype) == p.detach()
    if p.dtype == torch.bfloat16:
        near |= split_master(master)[0].view(p.shape) == p.detach()
    return near


def rounds_to(master: Tensor, p: Tensor) -> bool:
    return bool(_rounds(master, p).all())


def weight_wins(master: Tensor, p: Tensor) -> Tensor:
    """``master`` where it rounds to p's weight, the weight where not (written since)."""
    return torch.where(_rounds(master, p), master, p.detach().to(torch.float32))
