"""What bounds one optimizer step on a CPU core: compute (data in cache) against memory.

    python benchmarks/bench_optimizer_bounds.py [--cache-elems N] [--memory-elems N] [--repeats N]

One thread. Each contender steps one tensor of --cache-elems elements (sized to stay in the
core's L2 cache, so the time is the instructions', not the memory's) and one of --memory-elems
(far larger than the caches: the time a real model's step pays), ns per element, the rounds of all
contenders interleaved, best of --repeats. The in-cache column has the per-call cost taken out
(the time of a 256-element step subtracted), so it is the element loop's. Contenders: torch.optim.AdamW(fused=True) on fp32, and
peak.optimizers.FusedAdam (AdamW mode, bf16 weights, grads left scaled) with the state layouts of
bench_optimizers.py. Two floors measured with torch's own kernels on the cache-sized tensor:
`sqrt + div` (torch.sqrt then torch.div into preallocated outputs: the two correctly rounded
operations every exact Adam step pays per element) and `mul` (one multiply, for scale).
"""
import argparse
import ctypes
import subprocess
import tempfile
import time

from pathlib import Path

import torch

from peak.optimizers import FusedAdam

CONFIGS = {  # name: FusedAdam options (None: torch's fused AdamW on fp32)
    "torch AdamW fused fp32": None,
    "peak fp32 masters": {},
    "remainder, fp32 moments": dict(store_param_remainders=True),
    "remainder + bf16 (RNE)": dict(store_param_remainders=True, exp_avg_dtype=torch.bfloat16,
                                   exp_avg_sq_dtype=torch.bfloat16, moment_rounding="nearest"),
    "remainder + bf16 moments": dict(store_param_remainders=True, exp_avg_dtype=torch.bfloat16,
                                     exp_avg_sq_dtype=torch.bfloat16),
    "remainder + 8-bit (RNE)": dict(store_param_remainders=True, exp_avg_dtype=torch.uint8,
                                    exp_avg_sq_dtype=torch.uint8, moment_rounding="nearest"),
    "remainder + 8-bit moments": dict(store_param_remainders=True, exp_avg_dtype=torch.uint8,
                                      exp_avg_sq_dtype=torch.uint8),
}


def make_step(options, n):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=g).mul_(0.02)
    grad = torch.randn(n, generator=g).mul_(1e-3)
    if options is None:
        p = w.requires_grad_()
        p.grad = grad
        opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, fused=True)
        return opt.step
    p = w.to(torch.bfloat16).requires_grad_()
    p.grad = (grad * 1024).to(torch.bfloat16)
    scale, found = torch.tensor([1024.0]), torch.zeros(1)
    opt = FusedAdam([p], lr=1e-4, weight_decay=0.01, adam_w_mode=True,
                    store_unscaled_grads=False, **options)
    return lambda: opt.step(grad_scale=scale, found_inf=found)


PLAIN = "plain C loop, remainder + bf16 (RNE)"


def plain_loop():
    """benchmarks/adam_loop_floor.c's lean loop built as a shared library with its flags, so it
    runs interleaved with the contenders (None where no gcc builds it)."""
    src = Path(__file__).with_name("adam_loop_floor.c")
    lib = Path(tempfile.mkdtemp()) / "adam_loop_floor.so"
    flags = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
             "-march=x86-64-v4", "-mtune=generic", "-mprefer-vector-width=512"]
    try:
        subprocess.run(["gcc", *flags, "-DPLAIN_LOOP_LIBRARY", "-shared", "-fPIC", "-o", str(lib),
                        str(src), "-lm"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return ctypes.CDLL(str(lib)).plain_lean_step


def make_plain_step(fn, n):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=g).mul_(0.02).to(torch.bfloat16)
    grad = (torch.randn(n, generator=g).mul_(1e-3) * 1024).to(torch.bfloat16)
    buffers = (w, torch.zeros(n, dtype=torch.int16), grad, torch.zeros(n, dtype=torch.int16),
               torch.zeros(n, dtype=torch.int16))
    ptrs = [ctypes.c_void_p(t.data_ptr()) for t in buffers]
    return lambda: fn(n, *ptrs) and buffers  # (the closure keeps the buffers alive)


def best_ns_per_elem(fns, n, calls, repeats):
    for fn in fns.values():
        fn()
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - t0) / calls)
    return {name: t * 1e9 / n for name, t in best.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache-elems", type=int, default=65536)
    ap.add_argument("--memory-elems", type=int, default=16_000_000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    plain = plain_loop()

    def steps(n):
        fns = {k: make_step(o, n) for k, o in CONFIGS.items()}
        if plain is not None:
            fns[PLAIN] = make_plain_step(plain, n)
        return fns

    # The per-call cost (Python, dispatch) taken out: the time of a 256-element step subtracted.
    cached = best_ns_per_elem(steps(args.cache_elems), args.cache_elems, 200, args.repeats)
    tiny = best_ns_per_elem(steps(256), 256, 200, args.repeats)
    cached = {k: t - tiny[k] * 256 / args.cache_elems for k, t in cached.items()}
    big = best_ns_per_elem(steps(args.memory_elems), args.memory_elems, 2, args.repeats)
    a, b = torch.rand(args.cache_elems) + 1, torch.rand(args.cache_elems) + 1
    s, q = torch.empty_like(a), torch.empty_like(a)
    floors = best_ns_per_elem(
        {"sqrt + div": lambda: (torch.sqrt(b, out=s), torch.div(a, s, out=q)),
         "mul": lambda: torch.mul(a, b, out=q)}, args.cache_elems, 200, args.repeats)
    print(f"torch {torch.__version__}, 1 thread; in cache: {args.cache_elems} elements, "
          f"from memory: {args.memory_elems}; best of {args.repeats} interleaved rounds")
    print(f"{'contender':28s}{'in cache ns/el':>16s}{'memory ns/el':>14s}{'vs torch':>10s}")
    t_torch = big["torch AdamW fused fp32"]
    for name in CONFIGS:
        print(f"{name:28s}{cached[name]:16.3f}{big[name]:14.3f}{t_torch / big[name]:9.2f}x")
    if plain is not None:
        lean = "remainder + bf16 (RNE)"
        print(f"{PLAIN:28s}{cached[PLAIN]:16.3f}{big[PLAIN]:14.3f}{t_torch / big[PLAIN]:9.2f}x")
        print(f"{lean} / plain loop: {cached[lean] / cached[PLAIN]:.2f}x in cache, "
              f"{big[lean] / big[PLAIN]:.2f}x from memory (issue 23's target: 1.3x)")
    for name, t in floors.items():
        print(f"{'floor: ' + name:28s}{t:16.3f}")


if __name__ == "__main__":
    main()
