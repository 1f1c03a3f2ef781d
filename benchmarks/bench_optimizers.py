"""One optimizer step of a ~50M-parameter model (a transformer's size mix), O2-style.

    python benchmarks/bench_optimizers.py [--device cpu|cuda] [--dtype bf16|fp16] [--repeats N]
                                          [--threads T] [--levels active|all|LIST]

Contenders, all in one run, on the same parameter shapes:
- peak:     peak.optimizers.FusedAdam(adam_w_mode=True) on fp16/bf16 params and grads with fp32
            masters and moments, unscaling inside the step (grad_scale, found_inf) -- one pass.
- unfused:  Apex's O2 pipeline written with torch ops: unscale the low-precision grads into fp32
            master grads (torch._amp_foreach_non_finite_check_and_unscale_ after a copy),
            torch.optim.AdamW(foreach=True) on the fp32 masters, copy masters back to the model.
- torch fused: torch.optim.AdamW(fused=True) on an fp32 model (no masters: the fp32 baseline).
- peak no-master (bf16 only): FusedAdam(master_weights=False, stochastic_rounding=True) stepping
            the bf16 weights directly (no fp32 master: 6 fewer bytes per parameter; the
            rounding keeps small updates, see docs/core.md).
- copy:     a plain copy of a buffer of the peak step's byte count.
- in-place: ``a += b`` and ``a += b * c`` over the same byte count: the bandwidth of passes that
            write back where they read, as optimizer steps do (no write-allocate traffic).
Bytes per parameter are counted from the tensors each contender must read and write.
--levels all: the peak rows once per CPU level this machine runs (docs/build.md, "CPU levels").
"""
import argparse
import statistics
import time

import torch

import peak
from peak import ops
from peak.optimizers import FusedAdam


def shapes(d_model=512, layers=12, vocab=32000, ff=2048):
    out = [(vocab, d_model)]
    for _ in range(layers):
        out += [(d_model, d_model)] * 4 + [(d_model,)] * 4  # attention projections + biases
        out += [(ff, d_model), (ff,), (d_model, ff), (d_model,)]  # MLP
        out += [(d_model,)] * 4  # two layer norms
    out += [(d_model,), (d_model,)]
    return out


def timed(fn, device, repeats):
    fn()
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (CPU)")
    parser.add_argument("--levels", default="active",
                        help="CPU levels to run peak's steps at (docs/build.md): active (default), "
                             "all (every level this CPU runs) or a comma-separated list")
    args = parser.parse_args()
    if args.levels == "active" or args.device != "cpu":
        levels = [None]
    elif args.levels == "all":
        levels = ops.cpu_levels()["supported"]
    else:
        levels = args.levels.split(",")

    def at_levels(fn):
        """{level name: seconds} of fn at each requested CPU level."""
        out = {}
        for level in levels:
            if level is not None:
                peak._C._set_cpu_level(level)
            out[level or ops.cpu_level()] = timed(fn, dev, args.repeats)
        return out
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dev = args.device
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    g = torch.Generator().manual_seed(0)
    fp32 = [torch.randn(s, generator=g).mul_(0.02).to(dev) for s in shapes()]
    n = sum(p.numel() for p in fp32)
    scale = torch.tensor([1024.0], device=dev)
    grads32 = [torch.randn_like(p).mul_(1e-3) for p in fp32]

    # peak: low-precision model, fused step with masters.
    model = [p.to(low).requires_grad_() for p in fp32]
    for p, gr in zip(model, grads32):
        p.grad = (gr * scale).to(low)
    opt = FusedAdam(model, lr=1e-4, weight_decay=0.01, adam_w_mode=True)
    found = torch.zeros(1, device=dev)
    # The step writes grad / grad_scale back into p.grad (as torch's fused optimizers leave it):
    # timed with a scale of 1 so that repeated steps do not shrink the gradients into
    # subnormals (the kernel's work does not depend on the value).
    one = torch.ones(1, device=dev)
    t_peaks = at_levels(lambda: opt.step(grad_scale=one, found_inf=found))
    t_peak = list(t_peaks.values())[-1]  # the best level: the reference of the speedup column
    peak_bytes = 3 * low.itemsize + 4 * 6  # grad r+w, param w, master/m/v r+w
    # ...and without that write-back (store_unscaled_grads=False), at the best level.
    model_ns = [p.to(low).requires_grad_() for p in fp32]
    for p, gr in zip(model_ns, grads32):
        p.grad = (gr * scale).to(low)
    opt_ns = FusedAdam(model_ns, lr=1e-4, weight_decay=0.01, adam_w_mode=True,
                       store_unscaled_grads=False)
    t_peak_ns = timed(lambda: opt_ns.step(grad_scale=scale, found_inf=found), dev, args.repeats)
    peak_ns_bytes = 2 * low.itemsize + 4 * 6  # grad r, param w, master/m/v r+w

    # unfused Apex-style O2.
    model2 = [p.to(low) for p in fp32]
    low_grads = [(gr * scale).to(low) for gr in grads32]
    masters = [p.clone().requires_grad_() for p in fp32]
    for m in masters:
        m.grad = torch.empty_like(m)
    adamw = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01, foreach=True)
    inv = scale.reciprocal()

    def unfused():
        found.zero_()
        torch._foreach_copy_([m.grad for m in masters], low_grads)
        torch._amp_foreach_non_finite_check_and_unscale_([m.grad for m in masters], found, inv)
        adamw.step()
        torch._foreach_copy_(model2, masters)
    t_unfused = timed(unfused, dev, args.repeats)
    # copy in (2r+4w), unscale (4r+4w), AdamW foreach (~grad r, param/m/v r+w, plus temporaries),
    # copy back (4r+2w): counted as the minimum the passes must touch.
    unfused_bytes = (2 + 4) + (4 + 4) + (4 + 8 + 8 + 8) + (4 + 2) - 2 + low.itemsize

    # torch fused AdamW on fp32.
    model3 = [p.clone().requires_grad_() for p in fp32]
    for p, gr in zip(model3, grads32):
        p.grad = gr.clone()
    fused = torch.optim.AdamW(model3, lr=1e-4, weight_decay=0.01, fused=True)
    t_torch_fused = timed(fused.step, dev, args.repeats)
    torch_fused_bytes = 4 + 8 * 3

    t_no_master = None
    if low == torch.bfloat16:
        model4 = [p.to(low).requires_grad_() for p in fp32]
        for p, gr in zip(model4, grads32):
            p.grad = (gr * scale).to(low)
        opt4 = FusedAdam(model4, lr=1e-4, weight_decay=0.01, adam_w_mode=True,
                         master_weights=False, stochastic_rounding=True)
        t_no_masters = at_levels(lambda: opt4.step(grad_scale=scale, found_inf=found))
        t_no_master = list(t_no_masters.values())[-1]
    no_master_bytes = 2 + 2 * 2 + 4 * 4  # grad r, param r+w, m/v r+w

    # (written first: never-touched pages would be read as the shared zero page)
    src = torch.ones(n * peak_bytes // 8, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    t_copy = timed(lambda: dst.copy_(src), dev, args.repeats)
    copy_gbs = 2 * src.numel() * 4 / t_copy / 1e9
    del src, dst
    # In-place streams over the same byte count: what a pass that writes back where it read (as
    # an optimizer step does: no write-allocate traffic, unlike the copy) reaches with two and
    # with three input streams. A step moving as many bytes cannot beat its stream count's row.
    inplace = []
    for label, nstreams in (("in-place a += b", 2), ("in-place a += b * c", 3)):
        bufs = [torch.ones(n * peak_bytes // (4 * (nstreams + 1)), device=dev)
                for _ in range(nstreams)]
        op = ((lambda: bufs[0].add_(bufs[1])) if nstreams == 2
              else (lambda: bufs[0].addcmul_(bufs[1], bufs[2])))
        t = timed(op, dev, args.repeats)
        inplace.append((label, t, (nstreams + 1) * bufs[0].numel() * 4 / t / 1e9))
        del bufs

    print(f"peak {peak.__version__}, torch {torch.__version__}, device {dev}, "
          f"{n / 1e6:.1f}M params in {len(fp32)} tensors, low precision {args.dtype}, "
          f"threads {torch.get_num_threads()}")
    header = (f"{'contender':<37}{'ms/step':>9}{'B/param':>9}{'GB/s':>8}{'of copy':>9}"
              f"{'peak speedup':>14}")
    print(header)
    print("-" * len(header))
    tag = (lambda level: f" [{level}]") if levels != [None] else (lambda level: "")
    rows = [(f"peak FusedAdam (O2, fused){tag(level)}", t, peak_bytes)
            for level, t in t_peaks.items()]
    rows += [("  same, grads left scaled", t_peak_ns, peak_ns_bytes),
             ("(a) unfused Apex-style O2", t_unfused, unfused_bytes),
             ("(b) torch AdamW fused fp32", t_torch_fused, torch_fused_bytes)]
    if t_no_master is not None:
        rows += [(f"peak no-master bf16 + SR{tag(level)}", t, no_master_bytes)
                 for level, t in t_no_masters.items()]
    for name, t, b in rows:
        gbs = n * b / t / 1e9
        print(f"{name:<37}{t * 1e3:>9.2f}{b:>9d}{gbs:>8.1f}{gbs / copy_gbs:>9.2f}"
              f"{t / t_peak:>13.2f}x")
    print(f"{'plain copy':<37}{t_copy * 1e3:>9.2f}{'':>9}{copy_gbs:>8.1f}{1.0:>9.2f}")
    for label, t, gbs in inplace:
        print(f"{label:<37}{t * 1e3:>9.2f}{'':>9}{gbs:>8.1f}{gbs / copy_gbs:>9.2f}")
    if t_no_master is not None:
        for level, t in t_no_masters.items():
            print(f"peak no-master bf16 + SR{tag(level)} vs (b): {t_torch_fused / t:.2f}x")


if __name__ == "__main__":
    main()
