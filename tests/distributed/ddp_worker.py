"""The rank side of tests/distributed/test_ddp.py: every configuration trains the same small model
under DistributedDataParallel (gloo, CPU) for ``STEPS`` steps, each rank on its own data; rank 1
alone gets an inf loss at step 3 and a NaN input at step 7.  Records, per step, the loss scale and
whether the step changed anything, and at the end every parameter and optimizer-state tensor."""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_helpers import batch, make_model, reset_amp
from peak_testing import bitwise_equal, state_tensors

STEPS = 10
POISON = {3: "loss_inf", 7: "input_nan"}  # injected on rank 1 only
POISON_RANK = 1

# name -> (kind, opt_level / model dtype, low dtype, optimizer, dynamic scaling)
CONFIGS = {
    "amp-O0-f32": ("amp", "O0", None, "sgd", False),  # static scale 1: never skips, not poisoned
    "amp-O0-f32-dynamic": ("amp", "O0", None, "sgd", True),
    "amp-O1-f16": ("amp", "O1", torch.float16, "sgd", True),
    "amp-O1-bf16": ("amp", "O1", torch.bfloat16, "sgd", True),
    "amp-O2-f16": ("amp", "O2", torch.float16, "sgd", True),
    "amp-O2-bf16": ("amp", "O2", torch.bfloat16, "sgd", True),
    "amp-O2-f16-FusedAdam": ("amp", "O2", torch.float16, "fused_adam", True),
    "amp-O2-bf16-FusedAdam": ("amp", "O2", torch.bfloat16, "fused_adam", True),
    "amp-O3-f16": ("amp", "O3", torch.float16, "sgd", True),
    "amp-O3-bf16": ("amp", "O3", torch.bfloat16, "sgd", True),
    "scaler-autocast-f16": ("scaler", torch.float32, torch.float16, "sgd", True),
    "scaler-autocast-bf16": ("scaler", torch.float32, torch.bfloat16, "sgd", True),
    "scaler-bf16model-FusedAdam": ("scaler", torch.bfloat16, None, "fused_adam", True),
    "scaler-f16model-FusedAdam": ("scaler", torch.float16, None, "fused_adam", True),
}


def _optimizer(name, params):
    import peak.optimizers

    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return peak.optimizers.FusedAdam(params, lr=1e-2)


def _data(step, rank, poison):
    """Rank ``rank``'s batch, poisoned on ``POISON_RANK``; ``rank=None``: the single-process
    reference's batch, both ranks' rows concatenated (rank 1's rows poisoned the same way)."""
    if rank is None:
        (x0, y0), (x1, y1) = batch(step, 0), batch(step, 1)
        x1, what = _data_poison(step, x1, poison)
        return torch.cat([x0, x1]), torch.cat([y0, y1]), what
    x, y = batch(step, rank)
    if rank == POISON_RANK:
        x, what = _data_poison(step, x, poison)
        return x, y, what
    return x, y, None


def _data_poison(step, x, poison):
    what = POISON.get(step) if poison else None
    if what == "input_nan":
        x = x.clone()
        x[0, 0] = float("nan")
    return x, what


def run_amp(rank, opt_level, low, opt_name, dynamic):
    from peak import amp

    reset_amp()
    model = make_model()
    opt = _optimizer(opt_name, model.parameters())
    kwargs = {"low_precision_dtype": low} if low is not None else {}
    if dynamic:
        kwargs["loss_scale"] = "dynamic"
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0, **kwargs)
    ddp = DDP(model) if rank is not None else model
    scaler = amp._amp_state.loss_scalers[0]
    scales, skipped = [], []
    for step in range(STEPS):
        x, y, what = _data(step, rank, dynamic)
        before = state_tensors(model, opt)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x).float(), y)
        if what == "loss_inf":
            loss = loss * math.inf
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        skipped.append(bitwise_equal(before, state_tensors(model, opt)))
        scales.append(float(scaler.loss_scale()))
    return {"state": state_tensors(model, opt), "scales": scales, "skipped": skipped}


def run_scaler(rank, model_dtype, low, opt_name, dynamic):
    from peak import amp

    reset_amp()
    model = make_model().to(model_dtype)
    opt = _optimizer(opt_name, model.parameters())
    ddp = DDP(model) if rank is not None else model
    scaler = amp.GradScaler("cpu")
    scales, skipped = [], []
    for step in range(STEPS):
        x, y, what = _data(step, rank, dynamic)
        before = state_tensors(model, opt)
        opt.zero_grad()
        with amp.autocast("cpu", dtype=low or torch.bfloat16, enabled=low is not None):
            out = ddp(x.to(model_dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y)
        if what == "loss_inf":
            loss = loss * math.inf
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        skipped.append(bitwise_equal(before, state_tensors(model, opt)))
        scales.append(float(scaler.get_scale()))
    return {"state": state_tensors(model, opt), "scales": scales, "skipped": skipped,
            "skipped_steps": scaler.skipped_steps}


def control_local_inf_after_all_reduce(rank):
    """The control: an inf written into rank 1's gradient AFTER DDP's all-reduce is seen by
    rank 1 only (DDP gradients are not sharded, so GradScaler does not all-reduce the flag): the
    ranks disagree and their weights drift apart, and the comparisons above would notice."""
    from peak import amp

    reset_amp()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp = DDP(model)
    scaler = amp.GradScaler("cpu")
    skipped = []
    for step in range(4):
        x, y = batch(step, rank)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(ddp(x), y)).backward()
        if step == 2 and rank == POISON_RANK:
            next(model.parameters()).grad.view(-1)[0] = math.inf
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.last_step_skipped)
    return {"state": state_tensors(model, opt), "skipped": skipped, "scale": scaler.get_scale()}


def wrong_order(rank):
    """DDP first, then amp.initialize: the message for each opt_level."""
    from peak import amp

    out = {}
    for level in ("O2", "O3"):
        reset_amp()
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp = DDP(model)
        try:
            amp.initialize(ddp, opt, opt_level=level, verbosity=0)
            out[level] = None
        except RuntimeError as e:
            out[level] = (str(e), next(model.parameters()).dtype)
    return out


def accumulated_grads(rank, opt_level, opt_name, bucket_view):
    """Two micro-batches per step through scale_loss (no delay_unscale: the first one's unscaled
    gradients are set aside during the second backward) under DDP, one step: the gradients the
    step would read."""
    from peak import amp

    reset_amp()
    model = make_model()
    model, opt = amp.initialize(model, _optimizer(opt_name, model.parameters()),
                                opt_level=opt_level, low_precision_dtype=torch.float16, verbosity=0)
    ddp = DDP(model, gradient_as_bucket_view=bucket_view)
    for micro in range(2):
        x, y = batch(micro, rank)
        loss = torch.nn.functional.mse_loss(ddp(x).float(), y) / 2
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    return [p.grad.float().clone() for p in amp.master_params(opt)]


def bucket_view_accumulation(rank):
    """gradient_as_bucket_view=True (p.grad a view into DDP's bucket, which the next backward
    writes) against the default, for each kind of gradient set aside."""
    return {(level, opt): [accumulated_grads(rank, level, opt, view) for view in (False, True)]
            for level in ("O1", "O2") for opt in ("sgd", "fused_adam")}


class _BatchNormBetweenBf16(torch.nn.Module):
    """bf16 linears around an fp32 batch norm, whose fp32 gradients are set aside."""

    def __init__(self, seq):
        super().__init__()
        self.seq = seq

    def forward(self, x):
        return self.seq[2](self.seq[1](self.seq[0](x).float()).bfloat16())


def batch_norm_bucket_views(rank):
    """FP16_Optimizer and amp O2 over a model with an fp32 batch norm: a warm-up step (DDP
    rebuilds its buckets once), then two micro-batches; the batch norm's gradients with
    gradient_as_bucket_view=False and True."""
    from peak import amp
    from peak.fp16_utils import FP16_Optimizer

    def run(kind, view):
        reset_amp()
        torch.manual_seed(0)
        seq = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8),
                                  torch.nn.Linear(8, 1))
        if kind == "FP16_Optimizer":
            seq[0].bfloat16()
            seq[2].bfloat16()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (its deprecation)
                opt = FP16_Optimizer(torch.optim.SGD(seq.parameters(), lr=0.1),
                                     static_loss_scale=128.0, verbose=False)
            backward, zero = opt.backward, lambda: opt.zero_grad(set_grads_to_None=True)
        else:
            seq, opt = amp.initialize(seq, torch.optim.SGD(seq.parameters(), lr=0.1),
                                      opt_level="O2", low_precision_dtype=torch.bfloat16,
                                      loss_scale=128.0, verbosity=0)

            def backward(loss):
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            zero = opt.zero_grad
        ddp = DDP(_BatchNormBetweenBf16(seq), gradient_as_bucket_view=view)
        for it in range(2):
            zero()
            for micro in range(2):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * it + micro))
                backward(ddp(x.bfloat16()).float().pow(2).sum() / 2)
            if it == 0:
                opt.step()
        return [p.grad.clone() for p in seq[1].parameters()]

    return {kind: [run(kind, view) for view in (False, True)]
            for kind in ("FP16_Optimizer", "amp O2")}


def no_sync_accumulation(rank, delay_unscale):
    """Two micro-batches, the first under DDP's no_sync(): with delay_unscale on the first, its
    gradients stay in p.grad (scaled) for the second backward's all-reduce; without, they are set
    aside and never reduced, which scale_loss warns of. Returns (warned, gradients)."""
    import warnings

    from peak import amp

    reset_amp()
    model = make_model()
    model, opt = amp.initialize(model, _optimizer("sgd", model.parameters()), opt_level="O2",
                                low_precision_dtype=torch.float16, verbosity=0)
    ddp = DDP(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for micro in range(2):
            x, y = batch(micro, rank)
            with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                loss = torch.nn.functional.mse_loss(ddp(x).float(), y) / 2
                with amp.scale_loss(loss, opt, delay_unscale=delay_unscale and micro == 0) as s:
                    s.backward()
    warned = any("no_sync(), they never reach the all-reduce" in str(w.message) for w in caught)
    return warned, [p.grad.clone() for p in amp.master_params(opt)]


UNSEEDED_CONFIGS = [(low, opt) for low in (torch.float16, torch.bfloat16)
                    for opt in ("sgd", "fused_adam")] + [(torch.bfloat16, "remainders")]


def unseeded_ranks(rank):
    """amp O2, then DDP, over a model each rank initialized from its own seed (DDP's constructor
    broadcasts rank 0's weights, so torch scripts need not seed alike): three steps each."""
    import peak.optimizers
    from peak import amp

    out = {}
    for low, opt_name in UNSEEDED_CONFIGS:
        reset_amp()
        model = make_model(seed=rank)
        if opt_name == "remainders":
            opt = peak.optimizers.FusedAdam(model.parameters(), lr=1e-2, store_param_remainders=True)
        else:
            opt = _optimizer(opt_name, model.parameters())
        model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=low,
                                    verbosity=0)
        ddp = DDP(model)
        for step in range(3):
            x, y = batch(step, rank)
            opt.zero_grad()
            with amp.scale_loss(torch.nn.functional.mse_loss(ddp(x).float(), y), opt) as s:
                s.backward()
            opt.step()
        out[(low, opt_name)] = state_tensors(model, opt)
    return out


STOCHASTIC_CONFIGS = {
    "bf16_moments": dict(store_param_remainders=True, exp_avg_dtype=torch.bfloat16,
                         exp_avg_sq_dtype=torch.bfloat16),
    "8bit_moments": dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit"),
    "stochastic_weights": dict(master_weights=False, stochastic_rounding=True),
}


def unseeded_stochastic_rounding(rank):
    """The torch dialect on a bf16 model whose ranks torch seeded each its own way (as launchers
    do): DDP replicas round the same all-reduced gradients (stochastic bf16 moments, 8-bit codes,
    bf16 weights) and must round them alike."""
    import peak.optimizers

    out = {}
    for name, options in STOCHASTIC_CONFIGS.items():
        torch.manual_seed(1000 + rank)
        ddp = DDP(make_model(seed=rank).to(torch.bfloat16))
        opt = peak.optimizers.FusedAdamW(ddp.parameters(), lr=1e-2, **options)
        for step in range(3):
            x, y = batch(step, rank)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x.to(torch.bfloat16)).float(), y).backward()
            opt.step()
        out[name] = state_tensors(ddp.module, opt)
    return out


def worker(rank, world_size):
    results = {"unseeded": unseeded_ranks(rank), "stochastic": unseeded_stochastic_rounding(rank), "wrong_order": wrong_order(rank), "control": control_local_inf_after_all_reduce(rank),
               "bucket_view": bucket_view_accumulation(rank),
               "no_sync": [no_sync_accumulation(rank, delay) for delay in (False, True)],
               "batch_norm_views": batch_norm_bucket_views(rank)}
    for name, (kind, a, low, opt_name, dynamic) in CONFIGS.items():
        fn = run_amp if kind == "amp" else run_scaler
        results[name] = fn(rank, a, low, opt_name, dynamic)
    reset_amp()
    return results
