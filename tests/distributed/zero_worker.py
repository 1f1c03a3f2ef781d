"""The rank side of tests/distributed/test_zero_fsdp.py: ZeroRedundancyOptimizer (state sharded over
2 gloo ranks) around a DDP model, with peak.amp.GradScaler and with amp O2; FSDP2 fully_shard."""

from __future__ import annotations

import math

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_worker import POISON, STEPS, _data
from dist_helpers import make_model, reset_amp
from peak_testing import bitwise_equal


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def run_zero_scaler(rank, model_dtype, low, optimizer_class):
    from peak import amp

    reset_amp()
    model = make_model().to(model_dtype)
    ddp = DDP(model) if rank is not None else model
    if rank is not None:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, lr=1e-2)
    else:
        opt = optimizer_class(model.parameters(), lr=1e-2)
    scaler = amp.GradScaler("cpu")
    scales, skipped = [], []
    for step in range(STEPS):
        x, y, what = _data(step, rank, True)
        before = _params(model)
        opt.zero_grad()
        with amp.autocast("cpu", dtype=low or torch.bfloat16, enabled=low is not None):
            out = ddp(x.to(model_dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y)
        if what == "loss_inf":
            loss = loss * math.inf
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        skipped.append(bitwise_equal(before, _params(model)))
        scales.append(float(scaler.get_scale()))
    local_state = []
    inner = getattr(opt, "optim", opt)
    for group in inner.param_groups:
        for p in group["params"]:
            for k in sorted(inner.state.get(p, {})):
                v = inner.state[p][k]
                local_state.append(v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(float(v)))
    return {"params": _params(model), "scales": scales, "skipped": skipped,
            "skipped_steps": scaler.skipped_steps, "local_state": local_state}


def run_amp(rank, level, low):
    """amp O1/O3 (no master weights) with ZeRO sharding torch SGD's state over the ranks;
    ``rank=None``: a plain torch SGD in one process, the reference."""
    from peak import amp

    reset_amp()
    model = make_model()
    if rank is not None:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=1e-2,
                                      momentum=0.9)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=level, low_precision_dtype=low,
                                loss_scale="dynamic", verbosity=0)
    ddp = DDP(model) if rank is not None else model
    scaler = amp._amp_state.loss_scalers[0]
    scales, skipped = [], []
    for step in range(STEPS):
        x, y, what = _data(step, rank, True)
        before = _params(model)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x).float(), y)
        if what == "loss_inf":
            loss = loss * math.inf
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        skipped.append(bitwise_equal(before, _params(model)))
        scales.append(float(scaler.loss_scale()))
    return {"params": _params(model), "scales": scales, "skipped": skipped}


def amp_o2_error(rank):
    """amp O2's masters cannot live in ZeRO's param_groups: initialize says so, changing nothing."""
    from peak import amp

    reset_amp()
    model = make_model()
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=1e-2)
    try:
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
    except RuntimeError as e:
        return str(e), next(model.parameters()).dtype, hasattr(opt, "_amp_stash")
    return None


def run_fsdp2(rank, low, optimizer="Adam"):
    """FSDP2 ``fully_shard`` (parameters and gradients are DTensor shards) with GradScaler and
    autocast; the poison is written into rank 1's local gradient shard after the backward (so only
    that rank's shard sees it); ``rank=None``: one process, poisoned gradient, no sharding."""
    from peak import amp

    reset_amp()
    model = make_model()
    if rank is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    opt = resolve(optimizer)(model.parameters(), lr=1e-2)
    scaler = amp.GradScaler("cpu")
    scales, skipped = [], []
    for step in range(STEPS):
        x, y, _ = _data(step, rank, False)
        opt.zero_grad()
        with amp.autocast("cpu", dtype=low):
            out = model(x)
        scaler.scale(torch.nn.functional.mse_loss(out.float(), y)).backward()
        if step in POISON and rank in (None, 1):
            grad = list(model.parameters())[2].grad  # second Linear's weight
            local = grad.to_local() if rank is not None else grad
            local.view(-1)[-1] = float("inf") if POISON[step] == "loss_inf" else float("nan")
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.last_step_skipped)
        scales.append(float(scaler.get_scale()))
    params = [p.full_tensor() if rank is not None else p.detach() for p in model.parameters()]
    state = []
    for p in model.parameters():
        for k in sorted(opt.state.get(p, {})):
            v = opt.state[p][k]
            v = v.to_local() if hasattr(v, "to_local") else v
            state.append(v.detach().clone())
    return {"params": [t.detach().clone() for t in params], "scales": scales, "skipped": skipped,
            "local_state": state}


def run_fsdp2_amp(rank, optimizer):
    """FSDP2 with amp's Apex dialect at O1 (fp32 shards, fp16 casts per op, dynamic scaling):
    ``scale_loss`` unscales the local gradient shards and all-reduces its overflow flag, so the
    poison in rank 1's shard skips every rank -- on the device with a fused optimizer, on the
    host with a plain one."""
    from peak import amp

    reset_amp()
    model = make_model()
    if rank is not None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    opt = resolve(optimizer)(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O1", low_precision_dtype=torch.float16,
                                verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    scales, skipped = [], []
    for step in range(STEPS):
        x, y, _ = _data(step, rank, False)
        opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        with amp.scale_loss(torch.nn.functional.mse_loss(model(x).float(), y), opt) as scaled:
            scaled.backward()
            if step in POISON and rank in (None, 1):
                grad = list(model.parameters())[2].grad
                local = grad.to_local() if rank is not None else grad
                local.view(-1)[-1] = float("inf") if POISON[step] == "loss_inf" else float("nan")
        opt.step()
        skipped.append(all(torch.equal(a, b) for a, b in zip(before, model.parameters())))
        scales.append(scaler.loss_scale())
    params = [p.full_tensor() if rank is not None else p.detach() for p in model.parameters()]
    state = [v.to_local() if hasattr(v, "to_local") else v
             for p in model.parameters() for k, v in sorted(opt.state.get(p, {}).items())]
    return {"params": [t.detach().clone() for t in params], "scales": scales, "skipped": skipped,
            "local_state": [t.detach().clone() for t in state]}


def fsdp2_amp_o2_error(rank):
    """amp O2 over a model already under fully_shard: the explained error, nothing changed."""
    from peak import amp
    from torch.distributed.fsdp import fully_shard

    reset_amp()
    model = make_model()
    fully_shard(model)
    try:
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                       verbosity=0)
    except RuntimeError as e:
        return str(e), next(model.parameters()).dtype
    return None, None


def fsdp2_after_amp_o2_warns(rank):
    """amp O2 first, then fully_shard: FSDP2 replaces the parameters, so the optimizer holds the
    old ones and no step would change the model; scale_loss says so (a warning) instead of
    training silently standing still."""
    import warnings

    from peak import amp
    from peak.optimizers import FusedAdam
    from torch.distributed.fsdp import fully_shard

    reset_amp()
    out = {}
    for name, make in (("FusedAdam", FusedAdam), ("SGD", torch.optim.SGD)):
        reset_amp()
        model = make_model()
        model, opt = amp.initialize(model, make(model.parameters(), lr=0.1), opt_level="O2",
                                    low_precision_dtype=torch.bfloat16, verbosity=0)
        fully_shard(model)
        x, y, _ = _data(0, rank, False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with amp.scale_loss(torch.nn.functional.mse_loss(model(x).float(), y), opt) as s:
                s.backward()
        out[name] = [str(w.message) for w in caught if "none of the optimizer" in str(w.message)]
    return out


def run_fsdp2_without_agreement(rank):
    """The control: with GradScaler's all-reduce of the overflow flag switched off, the ranks
    disagree on the poisoned steps (so the agreement above is the all-reduce's doing)."""
    from peak.amp import grad_scaler

    saved = grad_scaler._agree_on_overflow
    grad_scaler._agree_on_overflow = lambda optimizer, flags: None
    try:
        return run_fsdp2(rank, torch.bfloat16)
    finally:
        grad_scaler._agree_on_overflow = saved


CONFIGS = {
    "zero-scaler-autocast-bf16-Adam": (torch.float32, torch.bfloat16, torch.optim.Adam),
    "zero-scaler-autocast-f16-SGD": (torch.float32, torch.float16, torch.optim.SGD),
    "zero-scaler-bf16model-FusedAdam": (torch.bfloat16, None, "FusedAdam"),
}


def resolve(cls):
    if isinstance(cls, str) and cls.startswith("Fused"):
        import peak.optimizers

        return getattr(peak.optimizers, cls)
    return getattr(torch.optim, cls) if isinstance(cls, str) else cls


def worker(rank, world_size):
    out = {"zero-amp-O1-bf16": run_amp(rank, "O1", torch.bfloat16),
           "zero-amp-O3-f16": run_amp(rank, "O3", torch.float16),
           "zero-amp-O2-error": amp_o2_error(rank),
           "fsdp2-scaler-autocast-bf16": run_fsdp2(rank, torch.bfloat16),
           "fsdp2-without-agreement": run_fsdp2_without_agreement(rank),
           "fsdp2-scaler-autocast-bf16-FusedAdam": run_fsdp2(rank, torch.bfloat16, "FusedAdam"),
           "fsdp2-amp-O1-f16-FusedAdam": run_fsdp2_amp(rank, "FusedAdam"),
           "fsdp2-amp-O1-f16-AdamW": run_fsdp2_amp(rank, "AdamW"),
           "fsdp2-amp-O2-error": fsdp2_amp_o2_error(rank),
           "fsdp2-after-amp-o2": fsdp2_after_amp_o2_warns(rank),
           "fsdp2-scaler-autocast-bf16-FusedLAMB": run_fsdp2(rank, torch.bfloat16, "FusedLAMB"),
           "fsdp2-scaler-autocast-bf16-FusedNovoGrad": run_fsdp2(rank, torch.bfloat16,
                                                                 "FusedNovoGrad")}
    for name, (mdt, low, cls) in CONFIGS.items():
        out[name] = run_zero_scaler(rank, mdt, low, resolve(cls))
    reset_amp()
    return out
