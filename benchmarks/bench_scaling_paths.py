"""The ways into the unscale kernel, priced (issue 15): what ``peak.ops`` costs over the raw op,
and what GradScaler's C++ walk over ``param_groups`` (csrc/bindings/param_grads.cpp) saves over
gathering the gradients in Python.

    python benchmarks/bench_scaling_paths.py [--repeats N] [--threads T]

Rows (CPU, fp32, times in microseconds, medians of interleaved runs):

- ``wrapper``: ``peak.ops.multi_tensor_scale_(grads, grads, inv, found)`` against
  ``torch.ops.peak.multi_tensor_scale_.default(grads, None, inv, found, 65536)`` on lists of
  N tensors of 256 elements;
- ``unscale_``: ``GradScaler.unscale_`` + ``update`` with the C++ walk against the same with the
  walk switched off (the Python gather and ``peak.scaling.unscale_grads_``).
"""
import argparse
import statistics
import time

import torch

import peak  # noqa: F401  (loads the kernels)
from peak import _C, amp, ops
from peak.amp import grad_scaler


def interleaved_medians(fns, repeats, inner, warmup=3):
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for r in range(repeats):
        order = list(zip(fns, times))
        for fn, ts in (order if r % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            ts.append((time.perf_counter() - t0) / inner)
    return [statistics.median(ts) for ts in times]


def wrapper_rows(repeats):
    raw = torch.ops.peak.multi_tensor_scale_.default
    rows = []
    for n in (1, 100, 5000):
        grads = [torch.ones(256) for _ in range(n)]
        inv = torch.ones(1)
        found = torch.zeros(1)
        inner = max(1, 2000 // n)
        t_raw, t_ops = interleaved_medians(
            [lambda: raw(grads, None, inv, found, 65536),
             lambda: ops.multi_tensor_scale_(grads, grads, inv, found)], repeats, inner)
        rows.append((f"wrapper {n}x256", "raw op", t_raw, "peak.ops", t_ops))
    return rows


def unscale_rows(repeats):
    rows = []
    for count, numel in ((5000, 256), (2000, 4096), (8, 2 * 1024 * 1024)):
        params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(count)]
        for p in params:
            p.grad = torch.ones(numel)
        opt = torch.optim.SGD(params, lr=0.0)
        scaler = amp.GradScaler("cpu", init_scale=1.0, growth_interval=10**9)
        scaler.scale(torch.ones(()))

        def step():
            scaler.unscale_(opt)
            scaler.update()

        def without_walk():
            grad_scaler._unscale_param_grads = _declined
            try:
                step()
            finally:
                grad_scaler._unscale_param_grads = _C.unscale_param_grads

        t_walk, t_py = interleaved_medians([step, without_walk], repeats, 1)
        rows.append((f"unscale_ {count}x{numel}", "C++ walk", t_walk, "Python gather", t_py))
    return rows


def _declined(*args):
    """The C++ walk declining an optimizer (as for a sparse gradient): the Python gather runs."""
    return -1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, cpu, {torch.get_num_threads()} threads, "
          f"median of {args.repeats}")
    for name, a, ta, b, tb in wrapper_rows(args.repeats) + unscale_rows(args.repeats):
        print(f"{name:<22} {a:>14} {ta * 1e6:10.1f} us   {b:>14} {tb * 1e6:10.1f} us   "
              f"{b} / {a} = {tb / ta:5.2f}")


if __name__ == "__main__":
    main()
