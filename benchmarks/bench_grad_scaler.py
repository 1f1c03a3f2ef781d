"""GradScaler: peak.amp.GradScaler vs torch.amp.GradScaler, in one run.

    python benchmarks/bench_grad_scaler.py [--device cpu|cuda] [--repeats N] [--threads T] [--quick]

Cases (fp32 gradients): many small tensors (2,000 x 4K elements, 5,000 x 256) and few large ones
(8 x 2M). For each case and each optimizer (SGD with foreach, AdamW fused: the
``_step_supports_amp_scaling`` hand-off), two measurements:

- ``full``: a whole training step ``zero_grad(set_to_none=False) -> scale(loss) -> backward -> unscale_ -> step ->
  update``; the loss touches every parameter once (``sum_i <p_i, x_i>``), so backward writes
  every gradient.
- ``scaler``: the scaler's own share, ``unscale_ -> step -> update`` around an optimizer whose
  step does nothing (same class flags), gradients pre-filled: what a user pays for GradScaler.

Times are medians of ``--repeats`` runs, the contenders timed in turn within each repeat
(another process may share the machine); ``ratio`` is
torch time / peak time (> 1: peak faster). ``reads`` counts host reads per step (``.item()``,
``.tolist()``, ``bool()``, ``float()``, ``int()`` on tensors) inside the measured step, for each
scaler: on CUDA each is a device sync; on CPU it is only a host read, counted anyway.
"""
import argparse
import statistics
import time

import torch

import peak  # noqa: F401  (loads the kernels)
from peak import amp

CASES = {"2000x4K": (2000, 4096), "5000x256": (5000, 256), "8x2M": (8, 2 * 1024 * 1024)}


class NoOpSGD(torch.optim.SGD):
    def step(self, closure=None):
        return None


class NoOpFusedAdamW(torch.optim.AdamW):
    _step_supports_amp_scaling = True

    def step(self, closure=None):
        return None


class HostReads:
    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__")

    def __init__(self):
        self.count = 0
        self._orig = {n: getattr(torch.Tensor, n) for n in self.NAMES}

    def __enter__(self):
        for n, fn in self._orig.items():
            def counted(t, *a, _fn=fn, **k):
                self.count += 1
                return _fn(t, *a, **k)
            setattr(torch.Tensor, n, counted)
        return self

    def __exit__(self, *exc):
        for n, fn in self._orig.items():
            setattr(torch.Tensor, n, fn)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def interleaved_medians(fns, device, repeats, warmup=3):
    """Median seconds of each function, timed in turn within every repeat (in alternating order)
    so that a load change on the machine hits every contender alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    sync(device)
    times = [[] for _ in fns]
    for r in range(repeats):
        order = list(zip(fns, times))
        for fn, ts in (order if r % 2 == 0 else order[::-1]):  # neither always goes first
            t0 = time.perf_counter()
            fn()
            sync(device)
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def make(count, numel, device, opt_kind, noop):
    params = [torch.nn.Parameter(torch.randn(numel, device=device) * 0.01) for _ in range(count)]
    xs = [torch.randn(numel, device=device) for _ in range(count)]
    if opt_kind == "sgd":
        opt = (NoOpSGD if noop else torch.optim.SGD)(params, lr=1e-3, foreach=True)
    else:
        opt = (NoOpFusedAdamW if noop else torch.optim.AdamW)(params, lr=1e-3, fused=True)
    return params, xs, opt


def full_step_fn(scaler, params, xs, opt):
    def step():
        # Gradients are kept and zeroed, not freed: freeing and re-allocating 8 MB gradients
        # every step lets glibc's malloc (its adaptive mmap threshold) decide the timing, and it
        # favoured whichever contender was built first by up to 2x in either direction.
        opt.zero_grad(set_to_none=False)
        loss = torch.stack([torch.dot(p, x) for p, x in zip(params, xs)]).sum()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    return step


def scaler_only_fn(scaler, params, opt):
    for p in params:
        p.grad = torch.ones_like(p)
    scaler.scale(torch.ones((), device=params[0].device))

    def step():
        scaler.unscale_(opt)  # scale 1.0: gradients stay 1.0 whatever the repeats
        scaler.step(opt)
        scaler.update()
    return step


def count_reads(fn):
    fn()  # warm (lazy state, signature caches)
    with HostReads() as r:
        fn()
    return r.count


def run(device, repeats, cases):
    rows = []
    for case in cases:
        count, numel = CASES[case]
        for opt_kind in ("sgd", "fused_adamw"):
            for what in ("full", "scaler"):
                fns, reads = [], []
                for cls in (torch.amp.GradScaler, amp.GradScaler):
                    torch.manual_seed(0)
                    params, xs, opt = make(count, numel, device, opt_kind, noop=(what == "scaler"))
                    scaler = cls(device, init_scale=(1.0 if what == "scaler" else 2.0**16),
                                 growth_interval=10**9)
                    fn = (full_step_fn(scaler, params, xs, opt) if what == "full"
                          else scaler_only_fn(scaler, params, opt))
                    reads.append(count_reads(fn))
                    fns.append(fn)
                t_torch, t_peak = interleaved_medians(fns, device, repeats)
                rows.append((case, opt_kind, what, (t_torch, reads[0]), (t_peak, reads[1])))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="small cases only, 5 repeats (a smoke run)")
    ap.add_argument("--threads", type=int, default=None,
                    help="intra-op threads (default: torch's); 1 is steadier on a busy machine")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cases = ["5000x256"] if args.quick else list(CASES)
    repeats = 5 if args.quick else args.repeats
    print(f"torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} threads, "
          f"median of {repeats}")
    header = (f"{'case':<10} {'optimizer':<12} {'measure':<8} {'torch ms':>9} {'peak ms':>9} "
              f"{'ratio':>6} {'torch reads':>11} {'peak reads':>10}")
    print(header)
    print("-" * len(header))
    for case, opt_kind, what, (tt, tr), (pt, pr) in run(args.device, repeats, cases):
        print(f"{case:<10} {opt_kind:<12} {what:<8} {tt * 1e3:9.3f} {pt * 1e3:9.3f} "
              f"{tt / pt:6.2f} {tr:11d} {pr:10d}")


if __name__ == "__main__":
    main()
