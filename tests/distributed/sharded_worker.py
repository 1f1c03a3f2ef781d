"""peak's fused optimizers stepping DTensor shards (NOTE: [Sharded steps]), run in gloo ranks.

Each config builds the same parameters on every rank, shards them with distribute_tensor
(Shard(0), what FSDP2's fully_shard makes) and hands every rank the same full gradients, sharded
alike, so that the result can be compared with one process stepping the whole tensors
(``rank=None``). Poisoned steps put an inf into ONE rank's local gradient shard only."""

from __future__ import annotations

import copy

import torch

from peak.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD
from peak.optimizers._quant import whole_block_rows

STEPS = 6
POISON_STEP = 3  # rank 1's shard (or, in one process, the same element) gets an inf
# Shapes: rows split over 2 and 4 ranks, a row count smaller than the world (empty shards on
# some ranks), a vector.
SHAPES = [(8, 5), (3, 4), (1, 6), (10,)]

CONFIGS = {
    # name: (model dtype, optimizer class, options)
    "adamw-fp32": (torch.float32, FusedAdam, dict(adam_w_mode=True, weight_decay=0.01)),
    "adam-bf16-masters": (torch.bfloat16, FusedAdam, {}),
    "adam-bf16-lean": (torch.bfloat16, FusedAdam,
                       dict(store_param_remainders=True, exp_avg_dtype=torch.bfloat16,
                            exp_avg_sq_dtype=torch.bfloat16, moment_rounding="nearest")),
    "sgd-bf16": (torch.bfloat16, FusedSGD, dict(momentum=0.9)),
    "adagrad-fp32": (torch.float32, FusedAdagrad, {}),
    # NovoGrad's infinity norm of each whole tensor: the maximum over the ranks' maxima, exact.
    "novograd-inf-norm-bf16": (torch.bfloat16, FusedNovoGrad, dict(norm_type=0)),
    # 8-bit moments: tensors whose rows are whole 256-element blocks keep 8-bit moments on any
    # number of ranks (their blocks are the one-process blocks); the others get bf16 moments.
    "adam-bf16-8bit": (torch.bfloat16, FusedAdam,
                       dict(store_param_remainders=True, exp_avg_dtype=torch.uint8,
                            exp_avg_sq_dtype=torch.uint8, moment_rounding="nearest")),
    "sgd-fp32-8bit": (torch.float32, FusedSGD, dict(momentum=0.9, momentum_dtype=torch.uint8,
                                                    moment_rounding="nearest")),
}
Q8_SHAPES = [(8, 256), (3, 512), (1, 256), (5, 300), (10,)]  # the last two: bf16 moments
# Clipping by the global norm: each rank's part of the sum of squares is summed over the mesh,
# another summation order than one process's, so the norm (and what it scales) may differ in the
# last bits: compared within a tolerance.
CLIPPED = {
    "adam-fp16-masters-clip": (torch.float16, FusedAdam, dict(max_grad_norm=0.5)),
    "sgd-bf16-clip": (torch.bfloat16, FusedSGD, dict(momentum=0.9, max_grad_norm=0.1)),
    # Per-tensor L2 norms of whole tensors (LAMB's trust ratio, NovoGrad's layer norms): each
    # rank's sum of squares, summed over the mesh.
    "lamb-bf16": (torch.bfloat16, FusedLAMB, dict(weight_decay=0.01)),
    "lamb-fp32-8bit": (torch.float32, FusedLAMB, dict(exp_avg_dtype=torch.uint8,
                                                      exp_avg_sq_dtype=torch.uint8,
                                                      moment_rounding="nearest")),
    "novograd-fp32": (torch.float32, FusedNovoGrad, dict(weight_decay=0.01)),
}
# Stochastic rounding draws its bits from each element's position in its tensor; a shard's
# positions differ from the whole tensor's, so these compare within a tolerance, not bits.
STOCHASTIC = {
    "adam-bf16-sr": (torch.bfloat16, FusedAdam, dict(master_weights=False,
                                                     stochastic_rounding=True)),
    "adam-bf16-lean-sr-moments": (torch.bfloat16, FusedAdam,
                                  dict(store_param_remainders=True,
                                       exp_avg_dtype=torch.bfloat16,
                                       exp_avg_sq_dtype=torch.bfloat16)),
}


def full_tensors(seed, dtype, name=None):
    g = torch.Generator().manual_seed(seed)
    shapes = Q8_SHAPES if name is not None and "8bit" in name else SHAPES
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def build_optimizer(name, params, rank):
    """The config's optimizer. One process (rank=None) gives the parameters the moments that
    shards give them: 8-bit where rows are whole blocks, bf16 elsewhere."""
    _, cls, options = {**CONFIGS, **CLIPPED, **STOCHASTIC}[name]
    if rank is not None or "8bit" not in name:
        return cls(params, lr=1e-2, **options)
    bf16 = {k: torch.bfloat16 for k in ("exp_avg_dtype", "exp_avg_sq_dtype", "momentum_dtype")
            if k in options}
    return cls([{"params": [p for p in params if whole_block_rows(p)]},
                {"params": [p for p in params if not whole_block_rows(p)], **bf16}],
               lr=1e-2, **options)


def sharder(rank):
    """t -> t as a Shard(0) DTensor over every rank (rank=None: one process, t itself)."""
    if rank is None:
        return lambda t: t
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    return lambda t: distribute_tensor(t, mesh, [Shard(0)])


def run(rank, name, scaled=True):
    """Steps config ``name``; rank=None: one process on the whole tensors. Returns the full
    weights, masters and moments after every step (gathered from the shards)."""
    dtype = {**CONFIGS, **CLIPPED, **STOCHASTIC}[name][0]
    torch.manual_seed(0)  # the stochastic rounding key
    weights = full_tensors(0, dtype, name)
    shard = sharder(rank)
    params = [torch.nn.Parameter(shard(w)) for w in weights]
    opt = build_optimizer(name, params, rank)
    grad_scale = torch.tensor([1024.0]) if scaled else None
    history, skipped = [], []
    for step in range(STEPS):
        grads = full_tensors(100 + step, torch.float32, name)
        for p, g in zip(params, grads):
            p.grad = shard((g * 1024.0 if scaled else g).to(dtype))
        found_inf = torch.zeros(1)
        if step == POISON_STEP:
            if rank is None:
                params[0].grad.view(-1)[-1] = float("inf")
            elif rank == 1:
                params[0].grad.to_local().view(-1)[-1] = float("inf")
            if rank in (None, 1):
                found_inf.fill_(1.0)  # this rank's own check found it; the step agrees
        opt.step(grad_scale=grad_scale, found_inf=found_inf)
        skipped.append(float(found_inf.item()))
        history.append(_full_state(params, opt))
    return {"history": history, "skipped": skipped}


def _full(t):
    """The whole tensor of a DTensor (16-bit ones gathered through float32, exactly: gloo has
    no 16-bit collectives)."""
    if not hasattr(t, "full_tensor"):
        return t
    if t.dtype in (torch.int16, torch.bfloat16, torch.float16):
        return t.to(torch.float32).full_tensor().to(t.dtype)
    return t.full_tensor()


def _full_state(params, opt):
    out = [_full(p.detach()).clone() for p in params]
    for p in params:
        st = opt.state.get(p, {})
        for key in sorted(st):  # (8-bit scales: [rows, blocks per row] on shards, flat in one
            value = _full(st[key]).detach().clone()  # process: the same blocks)
            out.append(value.reshape(-1) if key.endswith("_scale") else value)
    return out


ACCUMULATE = ["adam-bf16-masters", "adam-bf16-lean", "sgd-bf16"]


def run_accumulated(rank, name, micro=3):
    """fp32 gradient accumulation over ``micro`` micro-batches per step on the shards (bf16
    gradients, as FSDP2 hands bf16 shards): accumulate_grads() after each, then step()."""
    dtype, cls, options = CONFIGS[name]
    weights = full_tensors(0, dtype)
    shard = sharder(rank)
    params = [torch.nn.Parameter(shard(w)) for w in weights]
    opt = cls(params, lr=1e-2, **options)
    for step in range(3):
        for m in range(micro):
            for p, g in zip(params, full_tensors(100 + 10 * step + m, torch.float32)):
                p.grad = shard((g * 10.0 ** (m - 1)).to(dtype))
            opt.accumulate_grads()
        opt.step()
    return _full_state(params, opt)


def worker(rank, world_size):
    results = {name: run(rank, name) for name in {**CONFIGS, **CLIPPED, **STOCHASTIC}}
    results["accumulated"] = {name: run_accumulated(rank, name) for name in ACCUMULATE}
    results["state_dict_round_trip"] = state_dict_round_trip(rank)
    results["refusals"] = refusals()
    results["placements"] = placements(rank)
    results["reloaded"] = {name: reload_without_optimizer_state(rank, name) for name in RELOAD}
    results["norm_over_equal_meshes"] = norm_over_equal_meshes()
    results["plain_beside_shards"] = plain_beside_shards()
    results["rewritten_unchanged"] = rewritten_unchanged(rank)
    results["column_shards"] = column_shards_keep_bf16_moments()
    results["moved"] = {name: moved_after_steps(rank, name) for name in MOVED}
    return results


MOVED = ["adamw-fp32", "adam-bf16-masters", "adam-bf16-lean"]


def moved_after_steps(rank, name, move=True):
    """``module.to("cpu")`` between steps: a DTensor parameter is swapped in place
    (torch.utils.swap_tensors), which refuses a tensor with a weak reference (NOTE: [No weak
    references to parameters]); training goes on as without the move."""
    module, opt = _module(rank, name)
    _steps(module, opt, 0, 3)
    if move:
        module.to("cpu")
    _steps(module, opt, 3, 5)
    return _full_state(list(module.parameters()), opt)


def norm_over_equal_meshes():
    """Parameters on two equal meshes built apart (distinct objects, the same ranks): the global
    gradient norm reduces once per mesh, not once per object."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = torch.distributed.get_world_size()
    meshes = [init_device_mesh("cpu", (world,)) for _ in range(2)]
    full = full_tensors(3, torch.float32)[:2]
    params = [torch.nn.Parameter(distribute_tensor(w, m, [Shard(0)])) for w, m in zip(full, meshes)]
    for p in params:
        p.grad = p.detach().clone()
    opt = FusedAdam(params, max_grad_norm=1.0)
    return opt.grad_norm(), torch.cat([w.reshape(-1) for w in full]).norm()


def rewritten_unchanged(rank):
    """A weight written in place without change before every step (as nn.Embedding's max_norm
    does): its remainder is cleared once, then kept while its bits hold -- on each rank's shard
    as in one process."""
    weights = [w for w in full_tensors(0, torch.bfloat16) if w.dim() == 2]
    params = [torch.nn.Parameter(sharder(rank)(w)) for w in weights]
    opt = FusedAdam(params, lr=1e-2, store_param_remainders=True)
    for step in range(5):
        with torch.no_grad():
            for p in params:
                p.mul_(1)  # (moves the version counter, keeps the bits)
        for p, g in zip(params, full_tensors(100 + step, torch.float32)):
            p.grad = sharder(rank)(g.to(torch.bfloat16)) if g.dim() == 2 else None
        opt.step()
    return _full_state(params, opt)


def plain_beside_shards():
    """A plain (replicated) parameter beside DTensor shards in one optimizer: it is whole on
    every rank, so its part of the global norm and its per-tensor norms are not summed over the
    ranks. Returns (global norm, its expected value, NovoGrad's per-tensor norms after one step,
    their expected values)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    full = full_tensors(5, torch.float32)[:2]
    params = [torch.nn.Parameter(distribute_tensor(full[0], mesh, [Shard(0)])),
              torch.nn.Parameter(full[1].clone())]
    for p in params:
        p.grad = p.detach().clone()
    opt = FusedNovoGrad(params)
    norm = FusedAdam(params, max_grad_norm=1.0).grad_norm()
    opt.step()
    return (norm, torch.cat([w.reshape(-1) for w in full]).norm(),
            torch.stack([opt.state[p]["exp_avg_sq"] for p in params]),
            torch.stack([w.norm() for w in full]))


def column_shards_keep_bf16_moments():
    """8-bit moments need FSDP2's row sharding (Shard(0)): a Shard(1) parameter, whose blocks
    sharding would cut, gets bf16 moments and steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    p = torch.nn.Parameter(distribute_tensor(torch.randn(2, 1024), mesh, [Shard(1)]))
    opt = FusedAdam([p], exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
    p.grad = distribute_tensor(torch.ones(2, 1024), mesh, [Shard(1)])
    opt.step()
    return opt.state[p]["exp_avg"].dtype, torch.isfinite(p.full_tensor()).all().item()


RELOAD = ["adam-bf16-masters", "adam-bf16-lean"]


def reload_without_optimizer_state(rank, name):
    """The model reloaded through torch.distributed.checkpoint's set_model_state_dict (a full
    state dict, spread over the shards), the optimizer not: the masters follow the loaded
    weights (NOTE: [Masters after a model reload]) on the shards as in one process."""
    module, opt = _module(rank, name)
    _steps(module, opt, 0, 3)
    loaded = {f"w{i}": w for i, w in enumerate(full_tensors(7, CONFIGS[name][0]))}
    if rank is None:
        module.load_state_dict(loaded)
    else:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_model_state_dict)

        set_model_state_dict(module, loaded, options=StateDictOptions(full_state_dict=True))
    _steps(module, opt, 3, 5)
    return _full_state(list(module.parameters()), opt)


def state_dict_round_trip(rank):
    """Saved and loaded on the same mesh (torch's optimizer state dict, DTensor entries): the
    continued run matches the uninterrupted one bit for bit."""
    name = "adam-bf16-lean"
    dtype, cls, options = CONFIGS[name]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))

    def build():
        params = [torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
                  for w in full_tensors(0, dtype)]
        return params, cls(params, lr=1e-2, **options)

    def steps(params, opt, start, stop):
        for step in range(start, stop):
            for p, g in zip(params, full_tensors(100 + step, torch.float32)):
                p.grad = distribute_tensor(g.to(dtype), mesh, [Shard(0)])
            opt.step()

    params, opt = build()
    steps(params, opt, 0, 4)
    saved_weights = [p.detach().clone() for p in params]
    saved = copy.deepcopy(opt.state_dict())  # (torch's state dict holds the live tensors)
    steps(params, opt, 4, 6)
    uninterrupted = _full_state(params, opt)
    params2, opt2 = build()
    with torch.no_grad():
        for p, w in zip(params2, saved_weights):
            p.copy_(w)
    opt2.load_state_dict(saved)
    steps(params2, opt2, 4, 6)
    return uninterrupted, _full_state(params2, opt2)


def placements(rank):
    """Every state tensor but the step count is a DTensor placed like its parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    dtype, cls, options = CONFIGS["adam-bf16-lean"]
    params = [torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
              for w in full_tensors(0, dtype)]
    opt = cls(params, lr=1e-2, **options)
    for p in params:
        p.grad = distribute_tensor(torch.ones(p.shape, dtype=dtype), mesh, [Shard(0)])
    opt.step()
    out = []
    for p in params:
        for key, value in sorted(opt.state[p].items()):
            out.append((key, hasattr(value, "placements") and value.placements == p.placements
                        and value.shape == p.shape, hasattr(value, "placements")))
    return out


def refusals():
    """What peak does not step on shards is refused when the optimizer is built."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    replicated = [torch.nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, [Replicate()]))]
    messages = {}
    for name, build in {
        "replicated": lambda: FusedAdam(replicated),
    }.items():
        try:
            build()
            messages[name] = None
        except NotImplementedError as e:
            messages[name] = str(e)
    return messages


# ---- torch.distributed.checkpoint: saved on one number of ranks, resumed on another ---------------
RESHARD_CONFIGS = ["adamw-fp32", "adam-bf16-masters", "adam-bf16-lean", "sgd-bf16",
                   "novograd-inf-norm-bf16", "adam-bf16-8bit", "sgd-fp32-8bit"]
SAVE_AT = 3


def _module(rank, name):
    """The config's parameters as a module (DCP names state by parameter FQN), sharded over
    every rank (rank=None: one process, whole tensors), and its optimizer."""
    weights = full_tensors(0, CONFIGS[name][0], name)
    module = torch.nn.Module()
    module.config = name
    weights = [sharder(rank)(w) for w in weights]
    for i, w in enumerate(weights):
        module.register_parameter(f"w{i}", torch.nn.Parameter(w))
    return module, build_optimizer(name, list(module.parameters()), rank)


def _steps(module, opt, start, stop):
    from torch.distributed.tensor import distribute_tensor

    dtype = next(module.parameters()).dtype
    name = getattr(module, "config", None)
    for step in range(start, stop):
        for p, g in zip(module.parameters(), full_tensors(100 + step, torch.float32, name)):
            g = g.to(dtype)
            p.grad = (distribute_tensor(g, p.device_mesh, p.placements)
                      if hasattr(p, "device_mesh") else g)
        opt.step()


def dcp_save(rank, world_size, directory):
    """Steps every config SAVE_AT times and saves model and optimizer with DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from peak import amp

    for name in RESHARD_CONFIGS:
        module, opt = _module(rank, name)
        _steps(module, opt, 0, SAVE_AT)
        model_sd, optim_sd = get_state_dict(module, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=f"{directory}/{name}")
    scaler = amp.GradScaler("cpu", init_scale=2.0 ** 10)  # the loss scaler's state travels too
    scaler.scale(torch.ones(()))
    scaler.update(128.0)
    dcp.save({"scaler": scaler.state_dict()}, checkpoint_id=f"{directory}/scaler")
    return True


def dcp_resume(rank, world_size, directory):
    """Loads every config from DCP into fresh objects on this world size and steps on to STEPS;
    returns the full state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = {}
    for name in RESHARD_CONFIGS:
        module, opt = _module(rank, name)
        model_sd, optim_sd = get_state_dict(module, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=f"{directory}/{name}")
        set_state_dict(module, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        _steps(module, opt, SAVE_AT, STEPS)
        out[name] = _full_state(list(module.parameters()), opt)
    from peak import amp

    scaler = amp.GradScaler("cpu")
    state = {"scaler": scaler.state_dict()}
    dcp.load(state, checkpoint_id=f"{directory}/scaler")
    scaler.load_state_dict(state["scaler"])
    out["scaler_scale"] = scaler.get_scale()
    return out


def uninterrupted(name):
    module, opt = _module(None, name)
    _steps(module, opt, 0, STEPS)
    return _full_state(list(module.parameters()), opt)


def full_state_dict(rank, world_size, name):
    """The whole (unsharded) model and optimizer state dict, for export: StateDictOptions(
    full_state_dict=True) gathers every DTensor entry (rank 0 holds it, on the CPU)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    module, opt = _module(rank, name)
    _steps(module, opt, 0, STEPS)
    model_sd, optim_sd = get_state_dict(
        module, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": model_sd, "optim": optim_sd["state"]} if rank == 0 else None


def one_process_state_dict(name):
    module, opt = _module(None, name)
    _steps(module, opt, 0, STEPS)
    names = dict(zip(map(id, module.parameters()), (n for n, _ in module.named_parameters())))
    return {"model": {n: p.detach() for n, p in module.named_parameters()},
            "optim": {names[id(p)]: st for p, st in opt.state.items()}}


def lean_loads_in_either_order(rank, world_size):
    """A checkpoint of fp32 masters loaded into remainders, and one of remainders into fp32
    masters, on row shards, the model's weights before or after the optimizer's: (the saved
    weights and masters, and those after each load, as full tensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(0)
    full = torch.randn(8, 3, generator=g)
    out = {}
    for source, target in ((False, True), (True, False)):  # store_param_remainders
        p = torch.nn.Parameter(distribute_tensor(full.to(torch.bfloat16), mesh, [Shard(0)]))
        opt = FusedAdam([p], lr=1e-2, store_param_remainders=source)
        for i in range(2):
            p.grad = distribute_tensor(torch.randn(8, 3, generator=g).to(torch.bfloat16), mesh,
                                       [Shard(0)])
            opt.step()
        saved_opt, saved_weight = copy.deepcopy(opt.state_dict()), p.detach().clone()
        saved = (saved_weight.full_tensor(), opt.master_of(p).full_tensor())
        for optimizer_first in (False, True):
            q = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 3, dtype=torch.bfloat16),
                                                     mesh, [Shard(0)]))
            resumed = FusedAdam([q], lr=1e-2, store_param_remainders=target)

            def model_load():
                with torch.no_grad():
                    q.copy_(saved_weight)
            loads = [lambda: resumed.load_state_dict(copy.deepcopy(saved_opt)), model_load]
            for load in loads if optimizer_first else loads[::-1]:
                load()
            out[(source, optimizer_first)] = (saved, q.detach().full_tensor(),
                                              resumed.master_of(q).full_tensor())
    return out
