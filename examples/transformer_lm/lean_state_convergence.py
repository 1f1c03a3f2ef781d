"""Convergence of lean optimizer state (issue 16) on the char-level transformer LM of train.py.

Every configuration trains the same TinyGPT (same seed, same batches) for --steps bf16 O2 steps
with peak.optimizers.FusedAdam (AdamW), changing only the optimizer's storage:

    fp32 state            fp32 masters, fp32 moments (the baseline: today's O2)
    remainder             remainder masters (store_param_remainders=True), fp32 moments
    remainder+bf16        remainder masters, bf16 moments rounded stochastically (the default)
    bf16 moments          fp32 masters, bf16 moments (stochastic)
    remainder+bf16 (RNE)  the naive variant: bf16 moments rounded to nearest even
    bf16 moments (RNE)    the same with fp32 masters
    remainder+8bit        remainder masters, 8-bit block-quantized moments (exp_avg_sq rounded
                          stochastically, the default)
    8bit moments          fp32 masters, 8-bit moments
    remainder+8bit (RNE)  the naive variant: 8-bit exp_avg_sq rounded to nearest
    fp32 state, seed + 1  the baseline with another seed: the spread of an unchanged setup

--only NAME[,NAME...] runs the baseline and the named configurations and replaces (or appends)
their rows in the existing table; the plot then shows the runs of this invocation (written to
<out>_<suffix>.png with --plot-suffix).

Gradients are clipped inside the step (max_grad_norm=1.0: NOTE: [Clipping inside the step]), the
same arithmetic for every storage; clipping through amp.master_params would clip fp32 master
gradients in the fp32-master runs but the bf16 gradients themselves with remainders (there is no
fp32 master tensor to carry a gradient), a difference that has nothing to do with the storage.
and writes a markdown table (docs/_static/lean_state_convergence.md) and a plot
(docs/_static/lean_state_convergence.png):

    python examples/transformer_lm/lean_state_convergence.py --steps 1000 --threads 1
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import TinyGPT, batches, evaluate, load_text  # noqa: E402

from peak import amp  # noqa: E402
from peak.optimizers import FusedAdam, memory_report  # noqa: E402

BF16 = torch.bfloat16
LEAN = dict(exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16)
Q8 = dict(exp_avg_dtype=torch.uint8, exp_avg_sq_dtype=torch.uint8)
CONFIGS = {
    "fp32 state": {},
    "remainder": dict(store_param_remainders=True),
    "remainder+bf16": dict(store_param_remainders=True, **LEAN),
    "bf16 moments": dict(LEAN),
    "remainder+bf16 (RNE)": dict(store_param_remainders=True, moment_rounding="nearest", **LEAN),
    "bf16 moments (RNE)": dict(moment_rounding="nearest", **LEAN),
    "remainder+8bit": dict(store_param_remainders=True, **Q8),
    "8bit moments": dict(Q8),
    "remainder+8bit (RNE)": dict(store_param_remainders=True, moment_rounding="nearest", **Q8),
    # The spread of an unchanged setup: the baseline with another seed (weights and data order).
    "fp32 state, seed + 1": dict(seed_offset=1),
}


def train(name, kw, args, data):
    kw = dict(kw)
    seed = args.seed + kw.pop("seed_offset", 0)
    torch.manual_seed(seed)
    chars, train_data, val_data = data
    model = TinyGPT(len(chars), args.context, args.d_model, args.n_layers, args.n_heads)
    opt = FusedAdam(model.parameters(), lr=args.lr, weight_decay=0.01, adam_w_mode=True,
                    max_grad_norm=1.0, **kw)
    model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=BF16,
                                verbosity=0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps)
                                                                   / args.steps)))
    g = torch.Generator().manual_seed(seed)
    losses = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        x, y = batches(train_data, args.context, args.batch_size, g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    val = evaluate(model, val_data, args.context, "cpu")
    rep = memory_report(model, opt)
    print(f"{name:<22} final train loss (mean of last 50) {sum(losses[-50:]) / 50:.4f}  "
          f"val {val:.4f}  state {rep.total_per_param:.2f} B/param  "
          f"{time.perf_counter() - t0:.0f}s", flush=True)
    return losses, val, rep.total_per_param, [p.detach().clone() for p in model.parameters()]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "docs",
                                                 "_static", "lean_state_convergence"))
    p.add_argument("--only", default="", help="comma-separated configurations (with the "
                   "baseline) whose rows replace those of the existing table")
    p.add_argument("--plot-suffix", default="", help="write the plot to <out>_<suffix>.png")
    args = p.parse_args()
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in only if n not in CONFIGS]
    if unknown:
        p.error(f"--only: unknown configurations {unknown}; choose from {list(CONFIGS)}")
    torch.set_num_threads(args.threads)
    text = load_text("argparse")
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    chosen = {n: kw for n, kw in CONFIGS.items() if not only or n == "fp32 state" or n in only}
    runs = {name: train(name, kw, args, (chars, data[:split], data[split:]))
            for name, kw in chosen.items()}
    base_losses, base_val, _, base_weights = runs["fp32 state"]
    base_final = sum(base_losses[-50:]) / 50
    n_params = sum(w.numel() for w in base_weights)
    lines = [f"TinyGPT {n_params / 1e6:.2f}M params, {args.steps} O2 bf16 steps of "
             f"{args.batch_size}x{args.context} tokens, FusedAdam (AdamW, lr {args.lr}, cosine), "
             f"seed {args.seed}. Final loss: mean training loss of the last 50 steps.",
             "",
             "| configuration | state B/param | final loss | vs fp32 state | val loss | "
             "vs fp32 state | first step whose loss differs | final weights equal (elements) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, (losses, val, bpp, weights) in runs.items():
        final = sum(losses[-50:]) / 50
        same = sum(int((a == b).sum()) for a, b in zip(weights, base_weights))
        first = next((i for i, (a, b) in enumerate(zip(losses, base_losses)) if a != b), None)
        lines.append(f"| {name} | {bpp:.2f} | {final:.4f} | {100 * (final / base_final - 1):+.2f}% "
                     f"| {val:.4f} | {100 * (val / base_val - 1):+.2f}% | "
                     f"{'-' if first is None else first} | {100 * same / n_params:.1f}% |")
    if only and os.path.exists(args.out + ".md"):  # replace / append the rows of this run
        with open(args.out + ".md") as f:
            old = f.read().splitlines()
        new_rows = {ln.split(" | ")[0]: ln for ln in lines[4:]}
        base_row = new_rows.pop("| fp32 state")
        old_base = next((ln for ln in old if ln.startswith("| fp32 state |")), None)
        if old_base is not None and old_base.split(" | ")[2:5] != base_row.split(" | ")[2:5]:
            print("note: the baseline differs from the table's; its row is replaced")
        kept = [base_row if ln.startswith("| fp32 state |") else ln for ln in old
                if ln.split(" | ")[0] not in new_rows]
        at = next((i for i, ln in enumerate(kept) if ln.startswith("| fp32 state, seed")),
                  len(kept))
        lines = kept[:at] + list(new_rows.values()) + kept[at:]
    table = "\n".join(lines)
    print(table)
    with open(args.out + ".md", "w") as f:
        f.write(table + "\n")
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(8, 4.5))
    k = 25
    for name, (losses, *_rest) in runs.items():
        t = torch.tensor(losses)
        smooth = t.unfold(0, k, 1).mean(1)
        ax.plot(range(k - 1, len(losses)), smooth.numpy(), label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({k}-step mean)")
    ax.set_title("Lean optimizer state: TinyGPT, bf16 O2, FusedAdam")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    png = args.out + (f"_{args.plot_suffix}" if args.plot_suffix else "") + ".png"
    fig.savefig(png, dpi=110)
    print("wrote", args.out + ".md", "and", png)


if __name__ == "__main__":
    main()
