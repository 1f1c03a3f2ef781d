"""fp16 vs bf16 on the CPU: torch's own matrix products (not peak's kernels), the number behind
peak's one-time warning when fp16 is chosen on a CPU without native fp16 arithmetic.

Rows: a square matmul and a linear layer's forward + backward, each in bf16 and in fp16, median of
the fastest of 15 timed runs (a shared machine: the minimum is the least disturbed). Two fp16 columns:

* ``fp16 (this CPU)``: the path torch takes here. With AVX512-FP16 or AMX-FP16 (Sapphire Rapids
  and later) torch hands fp16 products to oneDNN, as it does bf16.
* ``fp16 (no native fp16)``: the same op with oneDNN switched off for it
  (``torch.backends.mkldnn.flags(enabled=False)``), which is the code path torch takes for fp16 on
  a CPU without those flags (AVX2, AVX-512 without FP16: Skylake to Ice Lake, AMD Zen 2-4): ATen's
  own fp16 GEMM. bf16 keeps oneDNN, as it does on any AVX-512 CPU.

Usage: python benchmarks/fp16_vs_bf16_cpu.py [--threads N]
"""
import argparse
import time

import torch


def _time(fn, repeats=15):
    fn()  # warm-up (oneDNN primitive creation)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples)  # the least-disturbed run: the machine is shared (2 cores, other jobs)


def _matmul(dtype, n):
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return lambda: torch.mm(a, b)


def _linear(dtype, batch, features):
    layer = torch.nn.Linear(features, features).to(dtype)
    x = torch.randn(batch, features).to(dtype)

    def run():
        layer.zero_grad(set_to_none=True)
        layer(x).float().sum().backward()
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cases = [("matmul 512x512", lambda d: _matmul(d, 512)),
             ("linear 1024 fwd+bwd, batch 256", lambda d: _linear(d, 256, 1024))]
    print(f"torch {torch.__version__}, {args.threads} thread(s), "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'op':32} {'bf16 ms':>8} {'fp16 ms (this CPU)':>25} {'fp16 ms (no native fp16)':>28}")
    for name, make in cases:
        bf16 = _time(make(torch.bfloat16))
        fp16 = _time(make(torch.float16))
        with torch.backends.mkldnn.flags(enabled=False):
            fp16_fallback = _time(make(torch.float16))
        print(f"{name:32} {bf16 * 1e3:8.2f} {fp16 * 1e3:16.2f} ({fp16 / bf16:5.1f}x) "
              f"{fp16_fallback * 1e3:18.2f} ({fp16_fallback / bf16:6.1f}x)")


if __name__ == "__main__":
    main()
