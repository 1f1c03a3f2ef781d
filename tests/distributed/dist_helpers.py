"""Multi-process helpers: spawn ``world_size`` gloo ranks on 127.0.0.1 (a free port), each runs a
worker function that writes its results to ``<out_dir>/rank<r>.pt``; the test compares them. The
ranks are spawned processes: they get the parent's sys.path (tests/ with peak_testing included)."""

from __future__ import annotations

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from peak_testing import make_mlp, regression_batch

WORLD_SIZE = 2
RANK_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, out_dir, args):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    # The watchdog: a collective that waits longer (a rank that died or took another path) raises
    # on every rank instead of hanging the suite.
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # Leave without Python's finalization: gloo's worker threads may still be destroying finished
    # work (broadcasts of Python-owned tensors) and then take the GIL of a finalizing interpreter,
    # which aborts the rank now and then ("terminate called without an active exception", seen
    # in a core dump: ProcessGroupGloo::runLoop -> ~AsyncBroadcastWork -> decref -> take_gil ->
    # pthread_exit). The results are on disk by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, out_dir, *args, world_size: int = WORLD_SIZE) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; returns their results."""
    mp.spawn(_entry, args=(world_size, free_port(), fn, str(out_dir), args), nprocs=world_size, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def reset_amp() -> None:
    from peak.amp import _caster
    from peak.amp._amp_state import _amp_state

    _caster.disable()
    _amp_state.reset()
    _amp_state.hard_override = False
    _amp_state.allow_incoming_model_not_fp32 = False
    _amp_state.verbosity = 0


def make_model(seed: int = 0) -> torch.nn.Module:
    """The distributed tests' model: Linear(16, 32) -> ReLU -> Linear(32, 4)."""
    return make_mlp(seed, 16, 4, hidden=32, act=torch.nn.ReLU)


def batch(step: int, rank: int, n: int = 8):
    """Rank ``rank``'s batch at ``step``: x (n, 16), y (n, 4)."""
    return regression_batch(1000 * step + rank, n, 16, 4)
