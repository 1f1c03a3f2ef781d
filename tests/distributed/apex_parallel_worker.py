"""The rank side of tests/distributed/test_apex_parallel.py: Apex's DistributedDataParallel through
peak's Apex alias, under amp O2 (fp16 and bf16 gradients) and in fp32, with Apex's options. Each
rank records its own gradients (before any all-reduce) and what the wrapper left in ``.grad``."""

from __future__ import annotations

import copy

import torch

from dist_helpers import batch, make_model, reset_amp

# name -> (opt_level or None for fp32, low dtype, Apex DDP keyword arguments)
CONFIGS = {
    "fp32": (None, None, {}),
    "fp32-predivide-4": (None, None, {"gradient_predivide_factor": 4.0}),
    "fp32-sum": (None, None, {"gradient_average": False}),
    # (Apex takes gradient_average_split_factor and never reads it)
    "fp32-sum-split-factor": (None, None, {"gradient_average": False,
                                           "gradient_average_split_factor": 4.0}),
    "O2-f16": ("O2", torch.float16, {}),
    "O2-f16-fp32-reduce": ("O2", torch.float16, {"allreduce_always_fp32": True}),
    "O2-bf16-delayed": ("O2", torch.bfloat16, {"delay_allreduce": True}),
}


def grads_after_backward(rank, name, wrap, copied=False):
    import peak.compat
    from peak import amp

    level, low, options = CONFIGS[name]
    reset_amp()
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if level is not None:
        model, opt = amp.initialize(model, opt, opt_level=level, low_precision_dtype=low,
                                    loss_scale=1.0, verbosity=0)
    if wrap:
        peak.compat.install_apex_alias()
        from apex.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, **options)
        if copied:  # (a deepcopy rebuilds torch's reducer: the all-reduce must stay Apex's)
            model = copy.deepcopy(model)
    x, y = batch(0, rank)
    torch.nn.functional.mse_loss(model(x).float(), y).backward()
    return [p.grad.clone() for p in (model.module if wrap else model).parameters()]


def worker(rank, world_size):
    out = {name: {"local": grads_after_backward(rank, name, False),
                  "wrapped": grads_after_backward(rank, name, True),
                  "copied": grads_after_backward(rank, name, True, copied=True)}
           for name in CONFIGS}
    # disable_allreduce: the gradients stay each rank's own
    import peak.compat
    peak.compat.install_apex_alias()
    from apex.parallel import DistributedDataParallel
    model = DistributedDataParallel(make_model(0))
    model.disable_allreduce()
    x, y = batch(0, rank)
    torch.nn.functional.mse_loss(model(x), y).backward()
    out["disabled"] = [p.grad.clone() for p in model.module.parameters()]
    # flat_dist_call (BERT's weight broadcast, a hand-made gradient average), fp32 and fp16 mixed
    from apex.parallel.distributed import flat_dist_call
    own = [torch.full((3,), 1.0 + rank), torch.full((2, 2), 10.0 * (rank + 1)).half(),
           torch.full((5,), -2.0 - rank)]
    broadcast = [t.clone() for t in own]
    flat_dist_call(broadcast, torch.distributed.broadcast, (0,))
    averaged = [t.clone() for t in own]
    flat_dist_call(averaged, torch.distributed.all_reduce)
    out["flat"] = {"own": own, "broadcast": broadcast, "averaged": averaged}
    # a parameter without a gradient, without delay_allreduce: the error names Apex's way out
    model = DistributedDataParallel(_Partly())
    try:
        for _ in range(2):
            torch.nn.functional.mse_loss(model(x), y).backward()
        out["unused"] = "no error"
    except RuntimeError as e:
        out["unused"] = str(e)
    return out


class _Partly(torch.nn.Module):
    """A model whose forward leaves one submodule out."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = make_model(0), make_model(1)

    def forward(self, x):
        return self.used(x)
