"""fp32 sums of fp16/bf16 gradients over micro-batches (``accumulate_grads``)."""
from __future__ import annotations

import warnings

import torch

from .. import _ranks
from .._stacklevel import user_stacklevel
from ._sharded import is_sharded
from .masters import master_in_state


# NOTE: [fp32 gradient accumulation] fp16/bf16 gradients accumulated by autograd over micro-batches
# round every partial sum (FSDP2 gives bf16 shards bf16 gradients). accumulate_grads() adds each
# into an fp32 sum instead (Megatron's main_grad) and drops it; the step steps the exact sum: an
# fp32 master takes it as its gradient, a remainder or master-less parameter gets it rounded once.
# Not with loss scaling (the sums would carry scales GradScaler never sees): for bf16 training.
def accumulate_fp32(optimizer) -> None:
    sums = optimizer.__dict__.setdefault("_fp32_grad_sums", {})
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None or p.dtype == torch.float32:
                continue  # (fp32 gradients accumulate in fp32 already)
            total = sums.get(p)
            sums[p] = p.grad.to(torch.float32) if total is None else total.add_(p.grad)
            p.grad = None
    if (sums and not optimizer.__dict__.get("_warned_replicated_sums")
            and _ranks.multi_rank_run() and not all(is_sharded(p) for p in sums)):
        optimizer._warned_replicated_sums = True  # (DDP all-reduces .grad; FSDP2's are reduced)
        warnings.warn(
            "accumulate_grads() on several ranks: gradients moved into the fp32 sums leave .grad, "
            "so if a micro-batch ran under DistributedDataParallel's no_sync(), it never reaches "
            "the all-reduce (the last backward all-reduces only its own) and the replicas step "
            "apart. With accumulate_grads let DDP all-reduce every micro-batch (no no_sync(): "
            "then nothing is wrong), or leave the accumulation to autograd (docs/distributed.md). "
            "Said once per optimizer.", stacklevel=user_stacklevel())


def check_fp32_sums(optimizer, grad_scale) -> None:
    if grad_scale is not None and optimizer.__dict__.get("_fp32_grad_sums"):
        raise ValueError(f"{type(optimizer).__name__}.step(): gradients were accumulated in fp32 "
                         "(accumulate_grads), which is for bf16 training without loss scaling; "
                         "with a loss scaler let autograd accumulate, or train in bf16 unscaled")


def take_fp32_sums(optimizer) -> bool:
    """Before a step: the fp32 sums become the gradients stepped (NOTE: [fp32 gradient
    accumulation]); a gradient since the last accumulate_grads() is added first (after
    check_fp32_sums, before anything changed)."""
    sums = optimizer.__dict__.get("_fp32_grad_sums")
    if not sums:
        return False
    del optimizer.__dict__["_fp32_grad_sums"]
    for p, total in sums.items():
        if p.grad is not None:
            total.add_(p.grad)
        p.grad = total.to(p.dtype)  # (the model's view of the gradient, rounded once)
        if optimizer.wants_master(p) and not optimizer.keeps_remainder(p):
            master_in_state(optimizer, p, optimizer.state[p]).grad = total
    return True
