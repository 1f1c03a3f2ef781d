"""FSDP2 on 2 gloo ranks (CPU): bytes held per rank per parameter, and a 200-step convergence
comparison on a small GPT-2 (transformers, built from a config: no download).

    python benchmarks/fsdp2_lean_state.py [--steps 200] [--world 2] [--width 128]

Configurations (every one under torch's fully_shard, one mesh dimension):

- torch: fp32 parameters, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32),
  torch.optim.AdamW(fused=True) -- torch's own mixed-precision FSDP2 recipe;
- peak fp32 masters: bf16 parameters, peak FusedAdamW keeping fp32 masters and fp32 moments;
- peak lean: bf16 parameters, FusedAdamW(store_param_remainders=True, bf16 moments): exact fp32
  masters as 16-bit remainders;
- peak lean 8-bit: the same with 8-bit moments, which shards keep for parameters whose rows are
  whole 256-element blocks (at width 128 the MLP's input weights, rows of 512; at width 256
  every weight); the others get bf16 moments (docs/distributed.md).

The bytes are counted from the tensors each rank holds between steps (its local shards of the
weights, gradients and optimizer state), divided by the parameters it owns; the all-gathered
bf16 weights that exist during forward and backward are transient and the same for all three.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIGS = ("torch AdamW fused, fp32 params + bf16 compute", "peak FusedAdamW, fp32 masters",
           "peak FusedAdamW, remainders + bf16 moments",
           "peak FusedAdamW, remainders + 8-bit moments")


def build(name, width=128):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    from peak.optimizers import FusedAdamW

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=4, n_embd=width, vocab_size=512, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    if name.startswith("torch"):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.transformer.h:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    else:
        model.to(torch.bfloat16)
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        moments = torch.uint8 if "8-bit" in name else torch.bfloat16
        lean = {} if "fp32 masters" in name else dict(
            store_param_remainders=True, exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
        opt = FusedAdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **lean)
    return model, opt


def batch(step, rank, n=8, length=32):
    """A learnable sequence task: each sequence counts up from a random start (mod vocab)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, 512, (n, 1), generator=g)
    return (start + torch.arange(length)) % 512


def local_bytes(t):
    t = t._local_tensor if hasattr(t, "_local_tensor") else t
    return t.numel() * t.element_size()


def run(rank, world, port, steps, out, width):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for name in CONFIGS:
        model, opt = build(name, width)
        losses = []
        for step in range(steps):
            ids = batch(step, rank)
            opt.zero_grad(set_to_none=False)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(loss.detach().float().item())
        owned = sum(local_bytes(p) // p.element_size() for p in model.parameters())
        held = {"weights": sum(local_bytes(p) for p in model.parameters()),
                "grads": sum(local_bytes(p.grad) for p in model.parameters()
                             if p.grad is not None),
                "masters": 0, "moments": 0}
        for st in opt.state.values():
            for key, v in st.items():
                if not isinstance(v, torch.Tensor) or key == "step":
                    continue
                held["masters" if key.startswith("master_param") else "moments"] += local_bytes(v)
        results[name] = {"losses": losses, "per_param": {k: v / owned for k, v in held.items()},
                         "owned": owned}
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=128, help="n_embd (256: every weight's rows "
                        "are whole 8-bit blocks)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(run, args=(args.world, port, args.steps, out, args.width), nprocs=args.world,
                 join=True)
        ranks = [torch.load(f"{out}/rank{r}.pt") for r in range(args.world)]
    import peak
    print(f"peak {peak.__version__}, torch {torch.__version__}, {args.world} gloo ranks (CPU), "
          f"GPT-2 2x{args.width}, {ranks[0][CONFIGS[0]]['owned']} parameters owned by rank 0")
    print("\nbytes held per rank per parameter it owns (rank 0)")
    print(f"{'configuration':50s} weights  grads masters moments  total")
    for name in CONFIGS:
        b = ranks[0][name]["per_param"]
        print(f"{name:50s} {b['weights']:7.2f} {b['grads']:6.2f} {b['masters']:7.2f} "
              f"{b['moments']:7.2f} {sum(b.values()):6.2f}")
    print(f"\nloss (mean over ranks) every {max(args.steps // 10, 1)} steps")
    every = max(args.steps // 10, 1)
    header = " ".join(f"{s:>6d}" for s in range(0, args.steps, every)) + f" {args.steps - 1:>6d}"
    print(f"{'configuration':50s} {header}")
    for name in CONFIGS:
        curve = [sum(r[name]["losses"][s] for r in ranks) / len(ranks) for s in
                 list(range(0, args.steps, every)) + [args.steps - 1]]
        print(f"{name:50s} " + " ".join(f"{x:6.3f}" for x in curve))


if __name__ == "__main__":
    sys.exit(main())
