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
the step. Per-tensor norms (LAMB's trust ratio, NovoGrad's layer norms) are of whole tensors: each
rank's part (squared, for L2) is reduced over the mesh in one collective per bucket; these
optimizers step empty shards too (the kernels take them), so every rank takes part and keeps
NovoGrad's per-tensor norms, plain replicated tensors, alike. The L2 sums go rank by rank (a
summation order of their own); the infinity norm's maximum is exact.
8-bit moments quantize blocks of 256 consecutive elements; FSDP2 shards rows, so a parameter
whose rows are whole blocks (decided from its global shape: ``_quant.whole_block_rows``) is cut
at block boundaries on any number of ranks: each rank holds whole blocks, the scales are shaped
``[rows, blocks per row]`` and sharded with the rows, and resharding moves no boundary. Other
parameters of an 8-bit group (vectors, rows of other lengths) keep bf16 moments.
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


def reduce_over_meshes(parts: Tensor, params, maximum: bool = False) -> Tensor:
    """``parts`` (each rank's sums of squares, or maxima) summed (or maxed) in place over the
    meshes of ``params`` (every DTensor parameter is sharded over its one mesh dimension:
    check_sharded_group)."""
    import torch.distributed as dist  # noqa: PLC0415

    op = dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM
    for mesh in _meshes(params):
        for dim in range(mesh.ndim):
            dist.all_reduce(parts, op=op, group=mesh.get_group(dim))
    return parts


def whole_tensor_norms(shard_lists: list[list[Tensor]], params, ord: float = 2.0) -> Tensor:
    """The norm of each whole tensor of ``params`` (DTensors), for each list of this rank's
    shards of them (empty ones included), in one reduce: float32 ``[lists, params]`` on their
    device (NOTE: [Sharded steps])."""
    shards = [t if t.numel() else t.new_zeros(1) for ts in shard_lists for t in ts]  # (max of
    norms = torch.stack(torch._foreach_norm(shards, ord, dtype=torch.float32))  # nothing: 0)
    parts = norms.view(len(shard_lists), -1)
    parts = parts if ord != 2.0 else parts * parts
    # A plain (replicated) tensor beside the shards is whole on every rank: not reduced.
    whole = torch.tensor([not is_sharded(p) for p in params], device=parts.device)
    reduced = reduce_over_meshes(torch.where(whole, 0.0, parts), params, maximum=ord != 2.0)
    parts = torch.where(whole, parts, reduced)
    return parts if ord != 2.0 else parts.sqrt()


def _meshes(params) -> list:
    """The distinct meshes of ``params``, by value: DTensor caches its sharding specs, so equal
    meshes built apart can reach one optimizer as different objects; one reduce per mesh."""
    meshes = []
    for p in params:
        if is_sharded(p) and not any(p.device_mesh == m for m in meshes):
            meshes.append(p.device_mesh)
    return meshes
