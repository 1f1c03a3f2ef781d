"""A parameter's memory layout and its optimizer state's: the kernels walk a parameter, its
gradient and its state as one block of memory, in the same order."""
from __future__ import annotations

import torch
from torch import Tensor

from ._quant import dequantize, load_moment, scale_key


def dense(t: Tensor) -> bool:
    """Its elements fill its memory without gaps or overlaps, in some order (transposed,
    channels_last): what the kernels can walk as one block."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


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
        state[key] = torch.empty_like(p, dtype=t.dtype).copy_(t)
        if t.grad is not None:  # (an fp32 master's gradient from give_master_grads)
            state[key].grad = torch.empty_like(p, dtype=t.dtype).copy_(t.grad)
    return not p.is_contiguous()


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
