"""The O1 caster (peak's C++ wrappers) against the alternatives, all on CPU, one run.

    python benchmarks/bench_caster.py [--repeats N] [--calls N] [--threads T] [--dtype bf16|f16]

(a) overhead every op pays, on ops in no list (relu, neg) and on a listed op whose arguments need
    no cast (add of two fp32 tensors: the promote policy looks, finds one dtype, calls through);
    tiny tensors (8 elements). Contenders: no casting, peak O1 (C++ wrappers in place of the
    listed callables), a pure-Python TorchFunctionMode that only calls through. Overhead = time
    per call minus the no-mode time; target: peak's overhead at most half the Python mode's.
(b) listed ops on tiny fp32 tensors: linear (input and Parameter weight cast to the low dtype,
    weight from the cast cache) and softmax (fp32 input: no cast) under peak O1 vs torch.autocast
    ("cpu", dtype) doing the same casts; target within 1.25x.
(c) a transformer block (d_model 512, 8 heads, seq 128, batch 4; linear/matmul/softmax/
    layer_norm/gelu written with torch.nn.functional) forward+backward under peak O1 vs
    torch.autocast with the same dtype; target within 10%.
(d) peak.amp.autocast("cpu", lower_ops=["exp"]) (a region list edit, on the caster's frames) vs
    torch.autocast, tiny tensors: an unlisted op (relu) and the edited one (exp, cast to the low
    dtype), ns per call.

Times are medians over --repeats rounds, the contenders timed in turn (alternating order) within
each round, so that another process on the machine hits all alike.
"""
import argparse
import contextlib
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import peak  # noqa: F401
from peak.amp import _caster, lists


class PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        return func(*args, **kwargs)


@contextlib.contextmanager
def o1(dtype):
    _caster.enable(dtype)
    try:
        yield
    finally:
        _caster.disable()


def interleaved_medians(fns, repeats, warmup=2):
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for r in range(repeats):
        order = list(zip(fns, times))
        for fn, ts in (order if r % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            inner = fn()  # a loop may time itself (to leave out entering its context)
            ts.append(inner if inner is not None else time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def loop(ctx_factory, op, calls):
    """Time ``calls`` calls of ``op`` inside the context (entering and leaving it not counted)."""
    def run():
        with ctx_factory():
            t0 = time.perf_counter()
            for _ in range(calls):
                op()
            return time.perf_counter() - t0
    return run


def bench_overhead(args, dtype):
    x, y = torch.randn(8), torch.randn(8)
    ops = {"relu (unlisted)": lambda: torch.relu(x), "neg (unlisted)": lambda: x.neg(),
           "add f32+f32 (promote, no cast)": lambda: torch.add(x, y)}
    rows = []
    for name, op in ops.items():
        ts = interleaved_medians(
            [loop(contextlib.nullcontext, op, args.calls), loop(lambda: o1(dtype), op, args.calls),
             loop(PassThrough, op, args.calls)], args.repeats)
        plain, patch_t, py_t = (t / args.calls * 1e9 for t in ts)
        rows.append((name, plain, patch_t, py_t, patch_t - plain, py_t - plain))
    print("\n(a) per-call overhead, tiny tensors (ns per call; target: overhead of peak O1 at most "
          "0.50x the pure-Python mode's)")
    print(f"{'op':32s} {'no mode':>8s} {'O1':>9s} {'py mode':>8s} "
          f"{'ovh O1':>10s} {'ovh py':>7s} {'O1/py':>9s}")
    for r in rows:
        print(f"{r[0]:32s} {r[1]:8.0f} {r[2]:9.0f} {r[3]:8.0f} {r[4]:10.0f} {r[5]:7.0f} "
              f"{r[4] / r[5]:9.2f}")
    return rows


def bench_listed(args, dtype):
    x = torch.randn(4, 16)
    lin = nn.Linear(16, 16)
    xs = torch.randn(4, 16)
    ops = {"linear (cast x, cached w)": lambda: F.linear(x, lin.weight, lin.bias),
           "softmax (fp32 in, no cast)": lambda: F.softmax(xs, -1)}
    rows = []
    for name, op in ops.items():
        with o1(dtype):
            a = op()
        with torch.autocast("cpu", dtype=dtype):
            b = op()
        peak_t, ta = interleaved_medians(
            [loop(lambda: o1(dtype), op, args.calls),
             loop(lambda: torch.autocast("cpu", dtype=dtype), op, args.calls)], args.repeats)
        rows.append((name, a.dtype, b.dtype, *(t / args.calls * 1e9 for t in (peak_t, ta))))
    print("\n(b) listed ops, tiny tensors (ns per call; target O1/autocast <= 1.25)")
    print(f"{'op':28s} {'O1 dtype':>15s} {'autocast dtype':>15s} {'O1':>9s} "
          f"{'autocast':>9s} {'O1/ac':>9s}")
    for r in rows:
        print(f"{r[0]:28s} {str(r[1]):>15s} {str(r[2]):>15s} {r[3]:9.0f} {r[4]:9.0f} "
              f"{r[3] / r[4]:9.2f}")
    return rows


class Block(nn.Module):
    def __init__(self, d=512, heads=8):
        super().__init__()
        self.h = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(F.layer_norm(x, (d,), self.ln1.weight, self.ln1.bias)).chunk(3, -1)
        q, k, v = (t.reshape(b, s, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        att = F.softmax(torch.matmul(q, k.transpose(-1, -2)) * (d // self.h) ** -0.5, -1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(F.layer_norm(x, (d,), self.ln2.weight, self.ln2.bias))))


def bench_block(args, dtype):
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(4, 128, 512)

    def step(ctx):
        def run():
            with ctx():
                out = block(x)
                loss = out.float().pow(2).mean()
            loss.backward()
            block.zero_grad(set_to_none=True)
        return run

    @contextlib.contextmanager
    def o1_like_autocast():
        # Apex's O1 runs softmax and gelu in fp32; torch's CPU autocast leaves them in the input's
        # (low) dtype. With them unlisted, both do the same casts: the mechanism's own cost.
        lists.remove(F.softmax, F.gelu)
        try:
            with o1(dtype):
                yield
        finally:
            lists.reset()

    peak_t, peak_same, ta, t32 = interleaved_medians(
        [step(lambda: o1(dtype)), step(o1_like_autocast),
         step(lambda: torch.autocast("cpu", dtype=dtype)), step(contextlib.nullcontext)],
        max(5, args.repeats // 2))
    print("\n(c) transformer block (d_model 512, seq 128, batch 4) forward+backward, ms "
          "(target peak/autocast <= 1.10)")
    print(f"{'peak O1 (Apex lists)':>21s} {'peak O1 (autocast casts)':>25s} {'autocast':>9s} "
          f"{'fp32':>8s} {'ratio Apex':>11s} {'ratio same':>11s}")
    print(f"{peak_t * 1e3:21.2f} {peak_same * 1e3:25.2f} {ta * 1e3:9.2f} {t32 * 1e3:8.2f} "
          f"{peak_t / ta:11.2f} {peak_same / ta:11.2f}")
    return peak_t, peak_same, ta, t32


def bench_region(args, dtype):
    from peak import amp  # noqa: PLC0415

    x = torch.randn(8)
    ops = {"relu (unlisted)": lambda: torch.relu(x), "exp (lower_ops edit)": lambda: torch.exp(x)}
    print("\n(d) autocast region with a list edit, tiny tensors (ns per call)")
    print(f"{'op':28s} {'peak edit':>10s} {'torch.autocast':>15s} {'ratio':>7s}")
    rows = []
    for name, op in ops.items():
        pe, ta = interleaved_medians(
            [loop(lambda: amp.autocast("cpu", dtype=dtype, lower_ops=["exp"]), op, args.calls),
             loop(lambda: torch.autocast("cpu", dtype=dtype), op, args.calls)], args.repeats)
        pe, ta = pe / args.calls * 1e9, ta / args.calls * 1e9
        rows.append((name, pe, ta))
        print(f"{name:28s} {pe:10.0f} {ta:15.0f} {pe / ta:7.2f}")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", choices=["bf16", "f16"], default="bf16")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, low dtype {dtype}")
    bench_overhead(args, dtype)
    bench_listed(args, dtype)
    bench_block(args, dtype)
    bench_region(args, dtype)


if __name__ == "__main__":
    main()
