"""The inf/NaN check of fp16/bf16 gradients alone (what ``amp.scale_loss``'s exit runs with a
fused optimizer and a dynamic scale, and GradScaler before a fused step): peak against torch.

    python benchmarks/bench_check_finite.py [--repeats N] [--threads 1]

The gradients of bench_optimizers.py's 54.2M-parameter model (195 tensors), 108 MB in fp16/bf16,
read cold (a 256 MB buffer is written before every timed call, as a backward pass would have
moved on since writing them). Contenders, interleaved in one run, median time and GB/s of
gradient bytes read:
- peak check:   peak.ops.multi_tensor_check_finite_(grads, found_inf) (reads the exponent bits of
                a 16-bit list: NOTE: [Finiteness from the bits] in csrc/core/elementwise_ops.h);
- torch sum:    g.sum() per gradient, the fastest pure read of torch's on this CPU (an
                int16 view's max(), amax() and torch.isfinite(g).all() are slower);
- torch check+unscale: torch._amp_foreach_non_finite_check_and_unscale_ with a scale of 1 (torch's
                own check; it also writes the gradients back, so it moves twice the bytes).
"""
import argparse
import statistics
import time

import torch

from bench_optimizers import shapes
from peak import ops


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(s, generator=g).mul_(1e-3) for s in shapes()]
    n = sum(t.numel() for t in base)
    flush = torch.empty(64 * 1024 * 1024)
    print(f"torch {torch.__version__}, {n / 1e6:.1f}M elements in {len(base)} tensors, "
          f"threads {torch.get_num_threads()}, median of {args.repeats} interleaved repeats")
    print(f"{'dtype':<6}{'contender':<22}{'ms':>8}{'GB/s read':>11}{'vs peak':>9}")
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        grads = [t.to(dtype) for t in base]
        found, one = ops.new_found_inf(), torch.ones(1)
        contenders = {
            "peak check": lambda: ops.multi_tensor_check_finite_(grads, found),
            "torch sum": lambda: [x.sum() for x in grads],
            "torch check+unscale": lambda: torch._amp_foreach_non_finite_check_and_unscale_(
                grads, found, one),
        }
        times = {k: [] for k in contenders}
        for _ in range(args.repeats):
            for k, fn in contenders.items():
                flush.fill_(1.0)
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        t_peak = statistics.median(times["peak check"])
        for k, ts in times.items():
            t = statistics.median(ts)
            print(f"{name:<6}{k:<22}{t * 1e3:>8.2f}{n * grads[0].itemsize / t / 1e9:>11.1f}"
                  f"{t / t_peak:>8.2f}x")


if __name__ == "__main__":
    main()
