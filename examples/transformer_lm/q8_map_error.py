"""Which 8-bit maps for Adam's moments (docs/core.md, "8-bit moments"): trains the TinyGPT of
train.py with torch.optim.AdamW in fp32, snapshots the moments, and measures, per candidate map
(blocks of 256, scale = block absmax, round to nearest, float64), the error it puts into Adam's
update m_hat / (sqrt(v_hat) + eps) when one moment is quantized and the other kept exact; and
(first) the rounding experiment behind stochastic rounding of exp_avg_sq:

    python examples/transformer_lm/q8_map_error.py --steps 300 --threads 1
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def float_levels(e, m):
    """Magnitudes of a small-float code relative to the block's unit (code 0 is 0)."""
    lv = [0.0] + [2.0 ** (k - (2 ** e - 1)) * (1 + mm / 2 ** m)
                  for k in range(2 ** e) for mm in range(2 ** m) if (k, mm) != (0, 0)]
    return np.array(lv), 2.0 - 2.0 ** -m


def linear_levels(n):
    return np.arange(n + 1, dtype=np.float64), float(n)


def quantize(x, levels, top, signed, sqrt, keep_positive=False):
    x = np.asarray(x, np.float64)
    pad = (-len(x)) % 256
    b = np.concatenate([x, np.zeros(pad)]).reshape(-1, 256)
    a = np.sqrt(b) if sqrt else np.abs(b)
    amax = a.max(1, keepdims=True)
    t = np.where(amax > 0, a / np.where(amax > 0, amax, 1) * top, 0)
    mids = (levels[1:] + levels[:-1]) / 2
    idx = np.searchsorted(mids, t, side="right")
    if keep_positive:
        idx = np.where((idx == 0) & (a > 0), 1, idx)
    mag = levels[idx] * amax / top
    if sqrt:
        mag = mag * mag
    out = np.where(b < 0, -mag, mag) if signed else mag
    return out.reshape(-1)[: len(x)]


M_MAPS = {"linear int8 (absmax/127)": (*linear_levels(127), True, False),
          "sign+E4M3": (*float_levels(4, 3), True, False),
          "sign+E3M4 (chosen)": (*float_levels(3, 4), True, False),
          "sign+E5M2": (*float_levels(5, 2), True, False)}
V_MAPS = {"linear uint8 on v": (*linear_levels(255), False, False),
          "linear uint8 on sqrt(v)": (*linear_levels(255), False, True),
          "E5M3 on v": (*float_levels(5, 3), False, False),
          "E4M4 on sqrt(v)": (*float_levels(4, 4), False, True),
          "E3M5 on sqrt(v) (chosen)": (*float_levels(3, 5), False, True)}


def _quantize_sr(x, levels, top, signed, sqrt, rng):
    """As quantize, rounding stochastically between the two neighbouring levels (one block)."""
    a = np.sqrt(x) if sqrt else np.abs(x)
    amax = a.max()
    t = a / amax * top
    i = np.clip(np.searchsorted(levels, t, side="right") - 1, 0, len(levels) - 2)
    p = (t - levels[i]) / (levels[i + 1] - levels[i])
    idx = np.where(rng.random(len(t)) < p, i + 1, i)
    if not signed:
        idx = np.where((idx == 0) & (a > 0), 1, idx)
    mag = levels[idx] * amax / top
    mag = mag * mag if sqrt else mag
    return np.where(x < 0, -mag, mag) if signed else mag


def stall_experiment():
    """One block of 256: half of the gradients drop 10x at step 1,000. exp_avg_sq (beta2 0.999,
    4,000 steps, 10% gradient noise) and exp_avg (beta1 0.9, 3,000 steps, noise 0.05), stored in
    8 bits after every step, rounded to nearest or stochastically; mean ratio to fp32."""
    rng = np.random.default_rng(0)
    cases = (("exp_avg_sq", V_MAPS["E3M5 on sqrt(v) (chosen)"], 0.999, 4000),
             ("exp_avg", M_MAPS["sign+E3M4 (chosen)"], 0.9, 3000))
    for name, (levels, top, signed, sqrt), beta, steps in cases:
        for sr in (False, True):
            x = np.zeros(256)
            ref = np.zeros(256)
            ratios = []
            for step in range(1, steps + 1):
                g = np.ones(256)
                if step >= 1000:
                    g[128:] = 0.1
                if name == "exp_avg_sq":
                    g = (g * (1 + 0.1 * rng.standard_normal(256))) ** 2
                else:
                    g = g + 0.05 * rng.standard_normal(256)
                ref = beta * ref + (1 - beta) * g
                new = beta * x + (1 - beta) * g
                x = (_quantize_sr(new, levels, top, signed, sqrt, rng) if sr
                     else quantize(new, levels, top, signed, sqrt, keep_positive=not signed))
                if name == "exp_avg" and step > 1100:
                    ratios.append((np.mean(x[128:]) / np.mean(ref[128:]),
                                   np.mean(x[:128]) / np.mean(ref[:128])))
            r = np.mean(ratios, 0) if ratios else (np.mean(x[128:]) / np.mean(ref[128:]),
                                                   np.mean(x[:128]) / np.mean(ref[:128]))
            print(f"{name:<11} {'stochastic' if sr else 'nearest':<11} changed elements / fp32 "
                  f"{r[0]:.4f}, unchanged / fp32 {r[1]:.4f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--stall", action="store_true", help="only the rounding experiment")
    args = p.parse_args()
    print("Rounding: a block whose gradients partly shrink (nearest vs stochastic)")
    stall_experiment()
    if args.stall:
        return
    from train import TinyGPT, batches, load_text  # noqa: PLC0415 (imports peak)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    text = load_text("argparse")
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    model = TinyGPT(len(chars), 64, 128, 2, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    snaps = {}
    for step in range(1, args.steps + 1):
        x, y = batches(data, 64, 16, g)
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step in (args.steps // 10, args.steps):
            snaps[step] = [(s["exp_avg"].reshape(-1).numpy().copy(),
                            s["exp_avg_sq"].reshape(-1).numpy().copy()) for s in opt.state.values()]
    for step, tensors in snaps.items():
        m = np.concatenate([t[0] for t in tensors]).astype(np.float64)
        v = np.concatenate([t[1] for t in tensors]).astype(np.float64)
        bc1, bc2 = 1 - 0.9 ** step, 1 - 0.999 ** step
        upd = lambda mm, vv: (mm / bc1) / (np.sqrt(vv / bc2) + 1e-8)  # noqa: E731
        u = upd(m, v)
        print(f"\nstep {step}: {len(m):,} elements; error of the update u = m_hat/(sqrt(v_hat)+eps)")
        print(f"{'map':<28}{'rel. L2 error of u':>20}{'median |du|/|u|':>18}{'max |u_q|/max |u|':>20}"
              f"{'zeroed':>9}")
        rows = [("exp_avg: " + k, quantize(np.concatenate([t[0] for t in tensors]), *vals), v)
                for k, vals in M_MAPS.items()]
        rows += [("exp_avg_sq: " + k, m, np.concatenate([quantize(t[1], *vals,
                  keep_positive=True) for t in tensors])) for k, vals in V_MAPS.items()]
        rows += [("exp_avg_sq: " + k + " (0 kept)", m, np.concatenate([quantize(t[1], *vals)
                  for t in tensors])) for k, vals in V_MAPS.items() if "linear" in k]
        for name, mq, vq in rows:
            uq = upd(mq, vq)
            rel = np.linalg.norm(uq - u) / np.linalg.norm(u)
            nz = np.abs(u) > 0
            med = np.median(np.abs(uq - u)[nz] / np.abs(u)[nz])
            zeroed = np.mean((mq == 0) & (m != 0)) if "exp_avg:" in name else np.mean((vq == 0) & (v != 0))
            print(f"{name:<44}{rel:>10.4f}{med:>14.4f}{np.abs(uq).max() / np.abs(u).max():>14.1f}"
                  f"{100 * zeroed:>8.2f}%")


if __name__ == "__main__":
    main()
