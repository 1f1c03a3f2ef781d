"""Whether this process is one rank of several: what every rank must decide alike, without a
collective (amp O2's masters, the optimizers' rounding seed)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def multi_rank_run() -> bool:
    """torch.distributed initialized with more than one rank, or a launcher's ``WORLD_SIZE`` (an
    integer) above 1 (torchrun sets it before the process group exists)."""
    world = os.environ.get("WORLD_SIZE", "1").strip()
    return (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
            or world.isdecimal() and int(world) > 1)


def agreed_seed() -> int:
    """torch's seed (32 bits) in one process; 0 on several ranks, which launchers seed each its
    own way while DDP's replicas must draw alike (the fused optimizers' rounding key)."""
    return 0 if multi_rank_run() else torch.initial_seed() % 2**32
