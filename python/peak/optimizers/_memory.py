"""``memory_report(model, optimizer)``: the training state's bytes per parameter, by part."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._checkpoint_check import MOMENT_KEYS
from .masters import MASTER_KEY, REMAINDER_KEY

PARTS = ("weights", "grads", "masters", "moments", "scales", "other")


@dataclass
class MemoryReport:
    """Bytes held by each part, for ``params`` model parameters. ``per_param[part]`` is bytes per
    parameter; ``total_per_param`` is their sum (weights + grads + optimizer state)."""

    params: int
    bytes: dict = field(default_factory=dict)

    @property
    def per_param(self) -> dict:
        return {k: v / max(self.params, 1) for k, v in self.bytes.items()}

    @property
    def total_per_param(self) -> float:
        return sum(self.bytes.values()) / max(self.params, 1)

    def __str__(self) -> str:
        rows = [f"{'part':<10}{'bytes':>16}{'B/param':>10}"]
        for part in PARTS:
            rows.append(f"{part:<10}{self.bytes[part]:>16,}{self.per_param[part]:>10.3f}")
        rows.append(f"{'total':<10}{sum(self.bytes.values()):>16,}{self.total_per_param:>10.3f}"
                    f"   ({self.params:,} parameters)")
        return "\n".join(rows)


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def memory_report(model: torch.nn.Module, optimizer, *, print_report: bool = False) -> MemoryReport:
    """What training ``model`` with ``optimizer`` keeps in memory, by part, per parameter:

    - ``weights``: the model's parameters;
    - ``grads``: their gradients, as the step reads them (a parameter without ``.grad`` yet is
      counted at its own dtype: the backward pass will give it one);
    - ``masters``: fp32 master weights, or 16-bit remainders (NOTE: [Remainder masters]);
    - ``moments``: the optimizer's moments / momentum buffers (8-bit ones: their uint8 codes)
      and any other state shaped as its parameter (Adagrad's ``sum``, RMSprop's ``square_avg``);
    - ``scales``: the per-block fp32 scales of 8-bit moments (``exp_avg_scale``...);
    - ``other``: step counts and anything else in the optimizer state.

    Tied parameters are counted once. Works for peak's fused optimizers and for torch
    optimizers (their state is walked the same way)."""
    seen: set[int] = set()
    parts = dict.fromkeys(PARTS, 0)
    n = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n += p.numel()
        parts["weights"] += _nbytes(p)
        if p.requires_grad:
            parts["grads"] += _nbytes(p.grad) if p.grad is not None else _nbytes(p)
    counted: set[int] = set()
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if not isinstance(value, Tensor) or id(value) in counted:
                continue
            counted.add(id(value))
            part = ("masters" if key in (MASTER_KEY, REMAINDER_KEY)
                    else "moments" if key in MOMENT_KEYS
                    else "scales" if key.endswith(("_scale", "_scales"))
                    else "moments" if value.dim() and value.shape == p.shape else "other")
            parts[part] += _nbytes(value)
    report = MemoryReport(params=n, bytes=parts)
    if print_report:
        print(report)
    return report
