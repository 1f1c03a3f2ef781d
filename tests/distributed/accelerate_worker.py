"""The rank side of tests/distributed/test_accelerate_ddp.py: peak's Apex dialect through
Accelerate on several gloo ranks, ``accelerator.accumulate`` over two micro-batches (the first
under DDP's ``no_sync()``), an inf in rank 1's first micro-batch at one fp16 step; and the same by hand
(DDP + amp as docs/distributed.md writes it) in the same processes."""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

from dist_helpers import batch, make_model, reset_amp

MICRO, STEPS, POISONED_STEP = 2, 4, 2


def _poison(model, rank, micro, dtype):
    """An inf in one gradient of rank 1's first micro-batch of POISONED_STEP (fp16: its dynamic
    scale skips the step; bf16's static scale of 1 would step on it)."""
    def hook(grad):
        if rank == 1 and dtype == "fp16" and micro["i"] == POISONED_STEP * MICRO:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad
    model[0].weight.register_hook(hook)


def _weights(model, optimizer):
    from peak import amp
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "masters": [m.detach().clone() for m in amp.master_params(optimizer)],
            "amp": amp.state_dict()}


def through_accelerate(rank, opt_level, dtype, delay_unscale, sync_each_batch=False):
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    from peak.integrations import accelerate as peak_accelerate
    reset_amp()
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(
        num_steps=MICRO, sync_each_batch=sync_each_batch))
    assert accelerator.num_processes == 2
    model = make_model(0)
    micro = {"i": 0}
    _poison(model, rank, micro, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = peak_accelerate.prepare(accelerator, model, optimizer, opt_level=opt_level,
                                               low_precision_dtype=dtype, verbosity=0)
    extra = {} if delay_unscale == "default" else {"delay_unscale": False}
    for i in range(STEPS * MICRO):
        micro["i"] = i
        x, y = batch(i, rank)
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x).float(), y)
            peak_accelerate.backward(accelerator, loss, optimizer, **extra)
            optimizer.step()
            optimizer.zero_grad()
    return _weights(accelerator.unwrap_model(model), peak_accelerate.unwrap_optimizer(optimizer))


def by_hand(rank, opt_level, dtype, sync_each_batch=False):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from peak import amp
    reset_amp()
    model = make_model(0)
    micro = {"i": 0}
    _poison(model, rank, micro, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level,
                                      low_precision_dtype=dtype, verbosity=0)
    ddp = DDP(model)
    for i in range(STEPS * MICRO):
        micro["i"] = i
        last = i % MICRO == MICRO - 1
        x, y = batch(i, rank)
        synced = last or sync_each_batch  # (every micro-batch all-reduced: nothing to delay)
        with contextlib.nullcontext() if synced else ddp.no_sync():
            loss = F.mse_loss(ddp(x).float(), y) / MICRO  # (Accelerate divides the loss too)
            with amp.scale_loss(loss, optimizer, delay_unscale=not synced) as scaled_loss:
                scaled_loss.backward()
        if last:
            optimizer.step()
            optimizer.zero_grad()
    return _weights(model, optimizer)


def worker(rank, world_size, opt_level, dtype):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the set-aside warning of the delay_unscale=False run)
        return {"default": through_accelerate(rank, opt_level, dtype, "default"),
                "no_delay": through_accelerate(rank, opt_level, dtype, False),
                "by_hand": by_hand(rank, opt_level, dtype),
                "sync_each_batch": through_accelerate(rank, opt_level, dtype, "default", True),
                "by_hand_synced": by_hand(rank, opt_level, dtype, sync_each_batch=True)}
