"""One optimizer step of a ~50M-parameter model (a transformer's size mix), O2-style.

    python benchmarks/bench_optimizers.py [--device cpu|cuda] [--dtype bf16|fp16] [--repeats N]
                                          [--threads 1,2] [--levels active|all|LIST]

Contenders, all in one run, on the same parameter shapes:
- peak:     peak.optimizers.FusedAdam(adam_w_mode=True) on fp16/bf16 params and grads with fp32
            masters and moments, unscaling inside the step (grad_scale, found_inf) -- one pass.
- lean (bf16 only, issue 16): the same step with remainder masters (store_param_remainders)
            and/or bf16 or 8-bit block-quantized moments (stochastic rounding of bf16 moments /
            8-bit exp_avg_sq; "RNE": rounded to nearest), grads left
            scaled (store_unscaled_grads=False).
- unfused:  Apex's O2 pipeline written with torch ops: unscale the low-precision grads into fp32
            master grads (torch._amp_foreach_non_finite_check_and_unscale_ after a copy),
            torch.optim.AdamW(foreach=True) on the fp32 masters, copy masters back to the model.
- amp O2:   the whole O2 step a user runs: amp.scale_loss's exit (no backward) and the FusedAdam
            step after amp.initialize(opt_level="O2"), fp32 masters (bf16: a static loss scale
            of 1; fp16: dynamic, grads unscaled in the step and stored back).
- torch fused: torch.optim.AdamW(fused=True) on an fp32 model (no masters: the fp32 baseline).
- peak no-master (bf16 only): FusedAdam(master_weights=False, stochastic_rounding=True) stepping
            the bf16 weights directly (no fp32 master: 6 fewer bytes per parameter; the
            rounding keeps small updates, see docs/core.md).
- copy:     a plain copy of a buffer of the peak step's byte count.
- in-place: ``a += b`` and ``a += b * c`` over the same byte count: the bandwidth of passes that
            write back where they read, as optimizer steps do (no write-allocate traffic).
Bytes per parameter are counted from the tensors each contender must read and write. The
repeats are interleaved (each round runs every contender once) and the median is reported, with
the ratio to (b) measured in the same run ("vs torch fused": above 1 is faster than torch).
--levels all: the peak rows once per CPU level this machine runs (docs/build.md, "CPU levels"),
interleaved with the others (the level is set before each call).
"""
import argparse
import statistics
import time

import torch

import peak
from peak import amp, ops
from peak.optimizers import FusedAdam


def shapes(d_model=512, layers=12, vocab=32000, ff=2048):
    out = [(vocab, d_model)]
    for _ in range(layers):
        out += [(d_model, d_model)] * 4 + [(d_model,)] * 4  # attention projections + biases
        out += [(ff, d_model), (ff,), (d_model, ff), (d_model,)]  # MLP
        out += [(d_model,)] * 4  # two layer norms
    out += [(d_model,), (d_model,)]
    return out


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed_interleaved(contenders, device, repeats):
    """Median seconds per call of each contender, the repeats interleaved (round r times every
    contender once), so that a burst of load from another process hits all of them alike. A
    contender is a function, or a (setup, function) pair whose setup runs untimed before each
    call."""
    contenders = {name: fn if isinstance(fn, tuple) else (None, fn)
                  for name, fn in contenders.items()}
    for setup, fn in contenders.values():  # warm-up (twice)
        for _ in range(2):
            if setup is not None:
                setup()
            fn()
    times = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, (setup, fn) in contenders.items():
            if setup is not None:
                setup()
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


LEAN = {  # name: (FusedAdam options, bytes per parameter moved)
    # grad r, param r+w, remainder r+w, m r+w (bf16), v r+w (bf16): 2 + 4 + 4 + 4 + 4
    "remainder + bf16 moments": (dict(store_param_remainders=True, exp_avg_dtype=torch.bfloat16,
                                      exp_avg_sq_dtype=torch.bfloat16), 18),
    "remainder + bf16 (RNE)": (dict(store_param_remainders=True, exp_avg_dtype=torch.bfloat16,
                                    exp_avg_sq_dtype=torch.bfloat16,
                                    moment_rounding="nearest"), 18),
    "remainder, fp32 moments": (dict(store_param_remainders=True), 2 + 4 + 4 + 16),
    "fp32 masters, bf16 moments": (dict(exp_avg_dtype=torch.bfloat16,
                                        exp_avg_sq_dtype=torch.bfloat16), 2 + 2 + 8 + 8),
    # grad r, param r+w, remainder r+w, m r+w (8-bit), v r+w (8-bit), + scales (4 B r+w per 256
    # elements each): 2 + 4 + 4 + 2 + 2 + 0.0625
    "remainder + 8-bit moments": (dict(store_param_remainders=True, exp_avg_dtype=torch.uint8,
                                       exp_avg_sq_dtype=torch.uint8), 14 + 16 / 256),
    "remainder + 8-bit (RNE)": (dict(store_param_remainders=True, exp_avg_dtype=torch.uint8,
                                     exp_avg_sq_dtype=torch.uint8, moment_rounding="nearest"),
                                14 + 16 / 256),
    "fp32 masters, 8-bit moments": (dict(exp_avg_dtype=torch.uint8,
                                         exp_avg_sq_dtype=torch.uint8), 2 + 2 + 8 + 4 + 16 / 256),
}


def amp_o2_step(fp32, grads32, low, dev):
    """The whole amp O2 step as a user runs it: scale_loss's exit (bf16: a static scale of 1,
    nothing to check or unscale; fp16: the dynamic scaler's inf/NaN check and its one host read)
    and FusedAdam.step (fp16: grads unscaled inside the step and stored back). Returns (setup,
    step): setup puts back the gradients a backward would have written (untimed; the fp16 step
    stores them unscaled), step is the timed call."""
    amp_model = torch.nn.ParameterList([torch.nn.Parameter(p.clone()) for p in fp32])
    amp_model, amp_opt = amp.initialize(
        amp_model, FusedAdam(amp_model.parameters(), lr=1e-4, weight_decay=0.01, adam_w_mode=True),
        opt_level="O2", low_precision_dtype=low, verbosity=0)
    amp_scale = amp._amp_state.loss_scalers[0].loss_scale()
    amp_grads = [(gr * amp_scale).to(low) for gr in grads32]
    params = list(amp_model.parameters())
    amp_loss = torch.zeros((), device=dev, requires_grad=True)
    fresh: list = []

    def setup():  # (fresh gradients each step: the fp16 step stores them unscaled)
        fresh[:] = [g.clone() for g in amp_grads]

    def amp_step():
        with amp.scale_loss(amp_loss, amp_opt):
            for p, g in zip(params, fresh):  # no backward: the gradients it would have written
                p.grad = g
        amp_opt.step()
    return setup, amp_step


def run(args, threads):
    torch.set_num_threads(threads)
    dev = args.device
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    g = torch.Generator().manual_seed(0)
    fp32 = [torch.randn(s, generator=g).mul_(0.02).to(dev) for s in shapes()]
    n = sum(p.numel() for p in fp32)
    scale = torch.tensor([1024.0], device=dev)
    grads32 = [torch.randn_like(p).mul_(1e-3) for p in fp32]
    found = torch.zeros(1, device=dev)
    one = torch.ones(1, device=dev)
    contenders, nbytes = {}, {}

    def add_peak(name, fn, b):
        """A peak contender, once per requested CPU level (the level set before each call)."""
        for level in args.cpu_levels:
            tagged = name if level is None else f"{name} [{level}]"
            contenders[tagged] = fn if level is None else (
                lambda lv: lambda: (peak._C._set_cpu_level(lv), fn()))(level)
            nbytes[tagged] = b

    def low_model():
        model = [p.to(low).requires_grad_() for p in fp32]
        for p, gr in zip(model, grads32):
            p.grad = (gr * scale).to(low)
        return model

    # peak: low-precision model, fused step with fp32 masters. The step writes grad / grad_scale
    # back into p.grad (as torch's fused optimizers leave it): timed with a scale of 1 so that
    # repeated steps do not shrink the gradients into subnormals (the work is the same).
    opt = FusedAdam(low_model(), lr=1e-4, weight_decay=0.01, adam_w_mode=True)
    # grad r+w, param w, master/m/v r+w
    add_peak("peak O2 fp32 masters", lambda: opt.step(grad_scale=one, found_inf=found),
             3 * low.itemsize + 4 * 6)
    # ...and without that write-back (store_unscaled_grads=False).
    opt_ns = FusedAdam(low_model(), lr=1e-4, weight_decay=0.01, adam_w_mode=True,
                       store_unscaled_grads=False)
    add_peak("  same, grads left scaled", lambda: opt_ns.step(grad_scale=scale, found_inf=found),
             2 * low.itemsize + 4 * 6)
    # The whole amp O2 step as a user runs it (amp_o2_step).
    contenders[AMP_ROW] = amp_o2_step(fp32, grads32, low, dev)
    # scale_loss exit: fp16 reads the grads (check); the step: grad r (+w for fp16), param w,
    # master/m/v r+w.
    nbytes[AMP_ROW] = (3 if low == torch.float16 else 1) * low.itemsize + low.itemsize + 4 * 6

    if low == torch.bfloat16:  # lean state (issue 16): grads left scaled
        lean_opts = {}
        for name, (kw, b) in LEAN.items():
            lean_opts[name] = FusedAdam(low_model(), lr=1e-4, weight_decay=0.01,
                                        adam_w_mode=True, store_unscaled_grads=False, **kw)
            add_peak(name, (lambda o: lambda: o.step(grad_scale=scale, found_inf=found))(
                lean_opts[name]), b)

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
        found.zero_()
    contenders["(a) unfused Apex-style O2"] = unfused
    # copy in (2r+4w), unscale (4r+4w), AdamW foreach (~grad r, param/m/v r+w, plus temporaries),
    # copy back (4r+2w): counted as the minimum the passes must touch.
    nbytes["(a) unfused Apex-style O2"] = (2 + 4) + (4 + 4) + (4 + 8 + 8 + 8) + (4 + 2) - 2 + low.itemsize

    # torch fused AdamW on fp32.
    model3 = [p.clone().requires_grad_() for p in fp32]
    for p, gr in zip(model3, grads32):
        p.grad = gr.clone()
    fused = torch.optim.AdamW(model3, lr=1e-4, weight_decay=0.01, fused=True)
    contenders[TORCH] = fused.step
    nbytes[TORCH] = 4 + 8 * 3

    if low == torch.bfloat16:
        opt4 = FusedAdam(low_model(), lr=1e-4, weight_decay=0.01, adam_w_mode=True,
                         master_weights=False, stochastic_rounding=True)
        add_peak("peak no-master bf16 + SR", lambda: opt4.step(grad_scale=scale, found_inf=found),
                 2 + 2 * 2 + 4 * 4)  # grad r, param r+w, m/v r+w

    times = timed_interleaved(contenders, dev, args.repeats)
    del contenders
    if args.cpu_levels != [None]:
        peak._C._set_cpu_level(ops.cpu_levels()["supported"][-1])

    # (written first: never-touched pages would be read as the shared zero page)
    peak_bytes = 3 * low.itemsize + 4 * 6
    src = torch.ones(n * peak_bytes // 8, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    t_copy = timed_interleaved({"copy": lambda: dst.copy_(src)}, dev, args.repeats)["copy"]
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
        t = timed_interleaved({label: op}, dev, args.repeats)[label]
        inplace.append((label, t, (nstreams + 1) * bufs[0].numel() * 4 / t / 1e9))
        del bufs

    print(f"peak {peak.__version__}, torch {torch.__version__}, device {dev}, "
          f"{n / 1e6:.1f}M params in {len(fp32)} tensors, low precision {args.dtype}, "
          f"threads {torch.get_num_threads()}, median of {args.repeats} interleaved repeats")
    width = max(28, max(len(name) for name in times) + 2)
    header = (f"{'contender':<{width}}{'ms/step':>9}{'B/param':>9}{'GB/s':>8}{'of copy':>9}"
              f"{'vs torch fused':>16}")
    print(header)
    print("-" * len(header))
    t_torch = times[TORCH]
    for name, t in times.items():
        b = nbytes[name]
        gbs = n * b / t / 1e9
        print(f"{name:<{width}}{t * 1e3:>9.2f}{b:>9.4g}{gbs:>8.1f}{gbs / copy_gbs:>9.2f}"
              f"{t_torch / t:>15.2f}x")
    print(f"{'plain copy':<{width}}{t_copy * 1e3:>9.2f}{'':>9}{copy_gbs:>8.1f}{1.0:>9.2f}")
    for label, t, gbs in inplace:
        print(f"{label:<{width}}{t * 1e3:>9.2f}{'':>9}{gbs:>8.1f}{gbs / copy_gbs:>9.2f}")
    print()


TORCH = "(b) torch AdamW fused fp32"
AMP_ROW = "amp O2 step (scale_loss + step)"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", default="1,2",
                        help="intra-op thread counts, comma-separated, one table each (CPU)")
    parser.add_argument("--levels", default="active",
                        help="CPU levels to run peak's steps at (docs/build.md): active (default), "
                             "all (every level this CPU runs) or a comma-separated list")
    args = parser.parse_args()
    if args.levels == "active" or args.device != "cpu":
        args.cpu_levels = [None]
    elif args.levels == "all":
        args.cpu_levels = ops.cpu_levels()["supported"]
    else:
        args.cpu_levels = args.levels.split(",")
    for threads in [int(t) for t in args.threads.split(",")]:
        run(args, threads)


if __name__ == "__main__":
    main()
