"""A parameter's memory layout and the tensors walked with it: the kernels (peak's, torch's fused
ones) walk a parameter, its gradient, its master and its state as blocks of memory in one order."""
from __future__ import annotations

import torch
from torch import Tensor

from ..scaling import local_shard
from ._quant import dequantize, load_moment, scale_key

UNSEEN = (-1, 0, None)  # a weight_stamp no weight has: compared element by element at its step


def weight_stamp(p: Tensor) -> tuple:
    """What tells whether p was written since: its version counter, its memory (a DTensor's is 0:
    only its version), its dtype. Read per parameter at each step: nothing more."""
    return p._version, p.data_ptr(), p.dtype


def state_for_master(state: dict) -> dict:
    """A low-precision parameter's torch-optimizer state, for its fp32 master: fp16/bf16 tensors
    widened (``initialize`` or a load cast it to the parameter's dtype, as Apex does)."""
    return {key: value.float() if isinstance(value, Tensor)
            and value.dtype in (torch.float16, torch.bfloat16) else value
            for key, value in state.items()}


def weight_checksum(p: Tensor) -> Tensor:
    """Of p's bits (a write that changes nothing, nn.Embedding's max_norm, keeps it)."""
    return local_shard(p).detach().view(torch.int16).sum(dtype=torch.int64)


def written_since(p: Tensor, seen: tuple, storage: bool = True) -> bool:
    """Since ``seen`` (its weight_stamp then): an in-place write (a version bump) or, with
    ``storage``, new memory of the same dtype (``p.data = ...``, as torch's ``prune.remove`` and
    ``vector_to_parameters`` write; a new layout, ``model.to(device)``: element by element, the
    same values change nothing). A new dtype (``model.half()``) is not a write of values."""
    return p._version != seen[0] or (storage and p.data_ptr() != seen[1] and p.dtype == seen[2])


def dense(t: Tensor) -> bool:
    """Its elements fill its memory without gaps or overlaps, in some order (transposed,
    channels_last): what the kernels can walk as one block."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def in_layout_of(p: Tensor, t: Tensor) -> Tensor:
    """A copy of t (p's shape) laid out in memory as p is, in t's dtype."""
    return torch.empty_like(p, dtype=t.dtype).copy_(t)


def follow_layout(p: Tensor, state: dict) -> bool:
    """The kernels walk a parameter and its state in one memory order: state made before the
    model's layout changed (``model.to(memory_format=torch.channels_last)``) takes the new layout,
    8-bit moments re-coded per block (their blocks follow memory order). Returns whether p is
    strided (not contiguous)."""
    stride = p.stride()
    for key, t in list(state.items()):
        if not isinstance(t, Tensor) or t.shape != p.shape or t.stride() == stride:
            continue
        if t.dtype == torch.uint8:
            moment = torch.empty_like(p, dtype=torch.float32)
            load_moment(state, key, moment.copy_(dequantize(t, state[scale_key(key)], key)), None,
                        torch.uint8, p)
            continue
        state[key] = in_layout_of(p, t)
        if t.grad is not None:  # (an fp32 master's gradient from give_master_grads)
            state[key].grad = in_layout_of(p, t.grad)
    return not p.is_contiguous()


def follow_master_layouts(masters: list, params: list, optimizer_ref) -> None:
    """Masters standing in for ``params`` in a torch optimizer's groups (kept: their data re-laid),
    their gradients and their state in that optimizer (``optimizer_ref``: a weak reference, or
    None) take their parameter's layout where it changed (``model.to(memory_format=...)``, which
    bumps no version). A parameter with gaps (a slice) keeps a dense master: the kernels stage it."""
    optimizer = optimizer_ref() if optimizer_ref is not None else None
    for master, p in zip(masters, params):
        if master.stride() == p.stride() or not dense(p):
            continue
        state = optimizer.state.get(master, {}) if optimizer is not None else {}
        moved = [k for k, t in state.items() if isinstance(t, Tensor) and t.shape == p.shape]
        if any(state[k].dtype == torch.uint8 for k in moved):  # (its blocks: in memory order)
            raise RuntimeError(
                f"{type(optimizer).__name__} keeps 8-bit state of its own ({moved}) for a "
                "parameter whose memory layout changed after amp.initialize (model.to(memory_"
                "format=...)): that state cannot follow. Change the memory format before "
                "amp.initialize.")
        master.data = in_layout_of(p, master)
        if master.grad is not None and not master.grad.is_sparse:
            master.grad = in_layout_of(p, master.grad)
        for key in moved:
            state[key] = in_layout_of(p, state[key])
