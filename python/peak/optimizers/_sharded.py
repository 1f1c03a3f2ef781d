"""DTensor parameters (FSDP2's ``fully_shard``) under peak's fused optimizers.

NOTE: [Sharded steps] The state is made from the parameter with DTensor ops (``zeros_like``,
``to``), so every moment, master and remainder is a DTensor sharded exactly like its parameter
(``torch.distributed.checkpoint`` sees it), while the step counts stay plain 0-dim tensors, as
torch's optimizers keep them. The kernels take the local shards: the per-element math is the
same, so a rank's shard gets the bits a single process gives those elements, except where an
element's position in its tensor keys random bits (stochastic rounding of bf16 weights and
moments): the shard's own positions key them, an equally unbiased but different stream. What
needs the whole tensor is reduced over the mesh: the global gradient norm (clipping) and the
overflow flag (every rank skips together). A rank whose shard is empty steps nothing but counts
the step. Per-tensor norms (LAMB's trust ratio, NovoGrad's layer norms) and 8-bit moments (blocks
of 256 over the flattened tensor, which sharding would cut) are refused when the optimizer is
built.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..scaling import local_shard


def is_sharded(t) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "placements")


local = local_shard  # (the scaling core's: one way to a local shard)


def check_sharded_group(optimizer, group: dict) -> None:
    """Refuse, when the optimizer is built, what peak does not step on DTensor shards."""
    params = [p for p in group["params"] if is_sharded(p)]
    if not params:
        return
    name = type(optimizer).__name__
    if not getattr(optimizer, "steps_shards", False):
        raise NotImplementedError(
            f"{name} takes per-tensor norms (a trust ratio or layer norm over the whole tensor) "
            "and does not step DTensor parameters (FSDP2's fully_shard): use FusedAdam/FusedAdamW, "
            "FusedSGD or FusedAdagrad, or a torch optimizer with peak.amp.GradScaler; see "
            "docs/distributed.md.")
    for key in ("exp_avg_dtype", "exp_avg_sq_dtype", "momentum_dtype"):
        if group.get(key) == torch.uint8:
            raise NotImplementedError(
                f"{name}({key}=torch.uint8): 8-bit moments quantize blocks of 256 elements of the "
                "flattened tensor, which FSDP2's sharding would cut; with DTensor parameters use "
                "bf16 moments (torch.bfloat16: 10 bytes per parameter with "
                "store_param_remainders=True)")
    for p in params:
        mesh = p.device_mesh
        if mesh.ndim != 1 or type(p.placements[0]).__name__ != "Shard":
            raise NotImplementedError(
                f"{name} steps DTensor parameters sharded over a one-dimensional mesh (FSDP2's "
                f"fully_shard); got a {mesh.ndim}-dimensional mesh with placements "
                f"{tuple(p.placements)}. Use fully_shard over one mesh dimension.")


def local_states(states: list[dict]) -> list[dict]:
    """The states with every DTensor entry replaced by its local shard (the kernels' view)."""
    return [{k: local(v) for k, v in st.items()} for st in states]


def count_empty_steps(states: list[dict], found_inf: Tensor | None) -> None:
    """A rank whose shard of a parameter is empty still counts the step (skipped or not), so
    that every rank's step count -- and the checkpoint's -- agrees."""
    for st in states:
        step = st["step"]
        if found_inf is None:
            step.add_(1)
        else:
            step.add_(1 - found_inf.to(step.device).reshape(()).clamp(max=1))


def reduce_sumsq(sumsq: Tensor, params) -> Tensor:
    """The global sum of squares from each rank's part (every DTensor parameter is sharded over
    its one mesh dimension: check_sharded_group)."""
    import torch.distributed as dist  # noqa: PLC0415

    for mesh in _meshes(params):
        for dim in range(mesh.ndim):
            dist.all_reduce(sumsq, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
    return sumsq


def _meshes(params) -> list:
    meshes = {}
    for p in params:
        if is_sharded(p):
            meshes.setdefault(id(p.device_mesh), p.device_mesh)
    return list(meshes.values())
