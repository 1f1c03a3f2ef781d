"""Unscale + inf/NaN check over a list of gradients: peak vs torch vs a plain copy.

    python benchmarks/bench_multi_tensor.py [--device cpu|cuda] [--repeats N] [--threads N]
                                            [--levels active|all|baseline,avx2,...]

Cases: (a) 2,000 tensors of 4K elements (many small grads), (b) 8 tensors of 4M elements (few
large grads), for fp32 and fp16 grads, in place (the GradScaler / amp O1 case). Contenders, all
in one run:
- peak:  peak.ops.multi_tensor_scale_(grads, grads, inv_scale, found_inf)
- torch: torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
- copy:  one flat tensor copied into another of the same byte size (reads N, writes N bytes:
         the memory-bandwidth ceiling for an in-place pass).
Prints a table of median times, GB/s (bytes read + written per second) and ratios.
--levels all: one peak row per CPU level this machine runs (docs/build.md, "CPU levels"), each
against the same torch and copy times; the default measures the level in use only.
"""
import argparse
import statistics
import time

import torch

import peak
from peak import ops

CASES = {"2000x4K": (2000, 4096), "8x4M": (8, 4 * 1024 * 1024)}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(device, repeats, levels):
    rows = []
    for case, (count, numel) in CASES.items():
        for dname, dtype in DTYPES.items():
            grads = [torch.randn(numel, device=device).to(dtype) for _ in range(count)]
            nbytes = 2 * count * numel * grads[0].element_size()  # read + write
            found_inf = torch.zeros(1, device=device)
            # Scale by exactly 1.0: values stay finite and unchanged across repeats, and both
            # contenders still do the full multiply (torch skips nothing for a tensor scale).
            inv_scale = torch.ones(1, device=device)
            # (written first: never-touched pages would be read as the shared zero page)
            src = torch.ones(count * numel, device=device, dtype=dtype)
            dst = torch.empty_like(src)

            t_torch = median_seconds(
                lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale),
                device, repeats)
            t_copy = median_seconds(lambda: dst.copy_(src), device, repeats)
            for level in levels:
                if level is not None:
                    peak._C._set_cpu_level(level)
                t_peak = median_seconds(
                    lambda: ops.multi_tensor_scale_(grads, grads, inv_scale, found_inf), device,
                    repeats)
                rows.append((case, dname, level or ops.cpu_level(), t_peak, t_torch, t_copy,
                             nbytes))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (peak's CPU tasks use the same pool)")
    parser.add_argument("--levels", default="active",
                        help="CPU levels to measure peak at: active (default), all (every level "
                             "this CPU runs) or a comma-separated list")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.levels == "active" or args.device != "cpu":
        levels = [None]
    elif args.levels == "all":
        levels = ops.cpu_levels()["supported"]
    else:
        levels = args.levels.split(",")
    rows = run(args.device, args.repeats, levels)
    print(f"peak {peak.__version__}, torch {torch.__version__}, device {args.device}, "
          f"threads {torch.get_num_threads()}")
    header = (f"{'case':<9}{'dtype':<6}{'level':<10}{'peak ms':>9}{'torch ms':>10}{'copy ms':>9}"
              f"{'peak GB/s':>11}{'torch GB/s':>11}{'copy GB/s':>11}{'vs torch':>10}{'of copy':>9}")
    print(header)
    print("-" * len(header))
    for case, dname, level, tp, tt, tc, nbytes in rows:
        gb = nbytes / 1e9
        print(f"{case:<9}{dname:<6}{level:<10}{tp * 1e3:>9.3f}{tt * 1e3:>10.3f}{tc * 1e3:>9.3f}"
              f"{gb / tp:>11.1f}{gb / tt:>11.1f}{gb / tc:>11.1f}{tt / tp:>9.2f}x{tc / tp:>9.2f}")


if __name__ == "__main__":
    main()
