"""DTensor parameters (FSDP2's ``fully_shard``) under peak's fused optimizers.

NOTE: [Sharded steps] (docs/distributed.md, "peak's fused optimizers on FSDP2 shards") The state
is made from the parameter with DTensor ops, so every moment, master and remainder is a DTensor
sharded like its parameter; step counts stay plain 0-dim tensors, as torch's. The kernels step the
local shards with the same per-element math (one process's bits, except stochastic rounding,
keyed by the shard's own positions: an equally unbiased, different stream). What needs the whole
tensor is reduced over the mesh: the global gradient norm and the overflow flag (every rank skips
together). A rank with an empty shard steps nothing but counts the step. Per-tensor norms (LAMB's
trust ratio, NovoGrad's layer norms) are of whole tensors, each rank's part (squared, for L2)
reduced in one collective per bucket; these optimizers step empty shards too, so every rank takes
part and NovoGrad's replicated norms stay alike (L2 sums go rank by rank; a maximum is exact).
8-bit moments: a parameter whose rows are whole 256-element blocks (from its global shape:
``_quant.whole_block_rows``) is cut at block boundaries on any number of ranks, its scales
``[rows, blocks per row]`` sharded with the rows; other parameters of an 8-bit group keep bf16."""
from __future__ import annotations

import torch
from torch import Tensor

# (reduce_over_meshes reduces over every mesh dimension: check_sharded_group allows one-dim meshes)
from ..scaling import local_shard, reduce_over_meshes


def is_sharded(t) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "placements")


local = local_shard  # (the scaling core's: one way to a local shard)


def check_sharded_group(optimizer, group: dict) -> None:
    """Refuse, when the optimizer is built, what peak does not step on DTensor shards."""
    for p in filter(is_sharded, group["params"]):
        mesh = p.device_mesh
        if mesh.ndim != 1 or type(p.placements[0]).__name__ != "Shard":
            raise NotImplementedError(
                f"{type(optimizer).__name__} steps DTensor parameters sharded over a "
                f"one-dimensional mesh (FSDP2's fully_shard); got a {mesh.ndim}-dimensional mesh "
                f"with placements {tuple(p.placements)}. Use fully_shard over one mesh dimension.")


def local_states(states: list[dict]) -> list[dict]:
    """The states with every DTensor entry replaced by its local shard (the kernels' view)."""
    return [{k: local(v) for k, v in st.items()} for st in states]


def count_empty_steps(states: list[dict], found_inf: Tensor | None) -> None:
    """A rank whose shard of a parameter is empty still counts the step (skipped or not), so
    that every rank's step count -- and the checkpoint's -- agrees."""
    for st in states:
        # (any nonzero flag skips: NOTE: [Any nonzero found_inf skips] in optimizer_launch.h)
        st["step"].add_(1 if found_inf is None
                        else found_inf.to(st["step"].device).reshape(()).eq(0).float())


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
