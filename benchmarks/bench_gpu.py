"""GPU benchmarks of issue 24: peak against torch on one CUDA device, as markdown tables.

    python benchmarks/bench_gpu.py [--device cuda|cpu] [--tiny] [--out FILE.md]
                                   [--sections unscale,optimizer,training] [--compile auto|on|off]
                                   [--deadline-s S] [--repeats N]

Sections (each table appended to --out and flushed as soon as it is measured, so a run cut short
keeps what it measured):
- unscale: unscale + inf/NaN check of fp16 gradients in place, `peak.ops.multi_tensor_scale_`
  against `torch._amp_foreach_non_finite_check_and_unscale_`, 8 x 16M elements (bandwidth-bound)
  and 2,000 x 4K (launch-bound: also timed as CUDA-graph replays, which leave out the host).
- optimizer: one step over a 355M-parameter list with GPT-2-medium shapes: the amp O2 step
  (bf16 weights, fp32 masters and moments, `FusedAdam`), the lean-state steps of
  `bench_optimizers.LEAN`, against `torch.optim.AdamW(fused=True)` on fp32 weights.
- training: one whole training step of GPT-2 small (transformers `GPT2Config()`, batch 8,
  sequence 1024, bf16, random token ids): amp O2 + FusedAdam and amp O1 against
  `torch.autocast` + `AdamW(fused=True)`; optionally the torch.compile'd model (no target).

Every contender of a table runs in the same process on the same device, the repeats interleaved
(each round runs every contender once); the median is reported. CUDA times come from CUDA events
around the timed call (untimed setup, such as putting gradients back, runs before the start
event). The ceiling is the device's own copy bandwidth: a device-to-device copy of a buffer of
the row's byte count, bytes read + written. --tiny (what `make gpu-check DRY_RUN=1` runs on the
CPU, timed with perf_counter) uses toy sizes: it exercises the code, its numbers mean nothing.
"""
import argparse
import contextlib
import datetime
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peak  # noqa: E402
from peak import _C, amp, ops  # noqa: E402
from peak.optimizers import FusedAdam  # noqa: E402
from bench_optimizers import LEAN, amp_o2_step  # noqa: E402  (rows built as the CPU bench builds them)

SECTIONS = ("unscale", "optimizer", "training")


# ---- timing

class Clock:
    """Seconds per call of a function on one device: CUDA events on a GPU, perf_counter on the
    CPU."""

    def __init__(self, device):
        self.cuda = device == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn, setup=None, iters=1):
        if setup is not None:
            setup()
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters

    def interleaved(self, contenders, rounds, warmup=2):
        """Median seconds per call of each contender; contenders: name -> (setup, fn, iters)."""
        for setup, fn, iters in contenders.values():
            for _ in range(warmup):
                self.time(fn, setup, iters)
        self.sync()
        times = {name: [] for name in contenders}
        for _ in range(rounds):
            for name, (setup, fn, iters) in contenders.items():
                times[name].append(self.time(fn, setup, iters))
        return {name: statistics.median(t) for name, t in times.items()}

    def graph_replay(self, fn, iters, rounds):
        """Seconds per call of ``fn`` captured ``iters`` times in one CUDA graph and replayed
        (the host's launch cost left out), or the reason it could not be captured."""
        if not self.cuda:
            return "no CUDA graphs on the CPU"
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(iters):
                    fn()
            graph.replay()
            self.sync()
            times = [self.time(graph.replay) / iters for _ in range(rounds)]
            return statistics.median(times)
        except Exception as e:  # a capture failure is a finding, not a crash of the benchmark
            return f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


def copy_seconds(clock, nbytes, device, rounds):
    """A device-to-device copy of a buffer of ``nbytes / 2`` bytes (reads it and writes as many:
    ``nbytes`` moved)."""
    # (written first: never-touched pages of a CPU buffer read as the shared zero page)
    src = torch.ones(max(1, int(nbytes // 2 // 4)), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = clock.interleaved({"copy": (None, lambda: dst.copy_(src), 1)}, rounds)["copy"]
    del src, dst
    return t


# ---- output

class Report:
    """Markdown tables appended to a file (flushed per table) and echoed to stdout."""

    def __init__(self, path):
        self.path = path

    def write(self, text):
        sys.stdout.write(text)
        sys.stdout.flush()
        if self.path:
            with open(self.path, "a") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())


def verdict(value, op, target):
    met = value >= target if op == ">=" else value <= target
    return f"{op} {target:g}", "met" if met else "**not met**"


def table(rows, columns):
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def header(args, title, sizes):
    dev = args.device
    name = torch.cuda.get_device_name() if dev == "cuda" else (platform.processor() or "cpu")
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    tiny = " **(tiny sizes, CPU dry run: not a measurement)**" if args.tiny else ""
    return (f"\n### {title}{tiny}\n\n{now}; device {dev} ({name}); torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}); peak {peak.__version__}; {sizes}; median of "
            f"{args.repeats} interleaved rounds\n\n")


# ---- unscale + inf/NaN check

def bench_unscale(args, clock, report):
    dev = args.device
    cases = ({"8x16M": (8, 16 * 2**20), "2000x4K": (2000, 4096)} if not args.tiny
             else {"8x64K": (8, 64 * 1024), "200x1K": (200, 1024)})
    rows = []
    for case, (count, numel) in cases.items():
        launch_bound = count > 100
        grads = [torch.randn(numel, device=dev).to(torch.float16) for _ in range(count)]
        found = ops.new_found_inf(dev)
        # Scaling by exactly 1 keeps the values finite and unchanged across repeats; both sides
        # still multiply every element.
        inv = torch.ones(1, device=dev)
        nbytes = 2 * count * numel * 2  # fp16, read + written
        iters = 20 if launch_bound and not args.tiny else 1
        # GradScaler.unscale_'s own way in: a C++ walk over the optimizer's param_groups and a
        # typed dispatcher call (bindings/param_grads.cpp), without the Python wrapper's boxing.
        params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
        for p, g in zip(params, grads):
            p.grad = g
        groups = [{"params": params}]
        contenders = {
            "peak multi_tensor_scale_": (None, lambda: ops.multi_tensor_scale_(grads, grads, inv, found), iters),
            "peak GradScaler path (param_groups walk in C++)": (
                None, lambda: _C.unscale_param_grads(groups, inv, found, False, 65536), iters),
            "torch _amp_foreach_non_finite_check_and_unscale_": (
                None, lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv), iters),
        }
        times = clock.interleaved(contenders, args.repeats)
        t_copy = copy_seconds(clock, nbytes, dev, args.repeats)
        t_peak, t_torch = times["peak multi_tensor_scale_"], times[
            "torch _amp_foreach_non_finite_check_and_unscale_"]
        graphs = {}
        if launch_bound:
            for name, (_, fn, _) in contenders.items():
                graphs[name] = clock.graph_replay(fn, 20, args.repeats)
        copy_gbs = nbytes / t_copy / 1e9
        for name, t in times.items():
            gbs = nbytes / t / 1e9
            ratio = t_torch / t
            targets = []
            if name.startswith("peak"):
                if not launch_bound:
                    targets.append(("of copy",) + verdict(gbs / copy_gbs, ">=", 0.85))
                targets.append(("vs torch",) + verdict(ratio, ">=", 1.0))
            g = graphs.get(name)
            gtxt = "" if g is None else (f"{g * 1e6:.1f} us" if isinstance(g, float) else g)
            rows.append([case, name, f"{t * 1e3:.3f}", f"{gbs:.0f}", f"{gbs / copy_gbs:.2f}",
                         f"{ratio:.2f}x", gtxt,
                         "; ".join(f"{k} {op}: {m}" for k, op, m in targets)])
        rows.append([case, "D2D copy of the same bytes", f"{t_copy * 1e3:.3f}",
                     f"{copy_gbs:.0f}", "1.00", "", "", ""])
        del grads, params, groups
    report.write(header(args, "Unscale + inf/NaN check, fp16 gradients, in place",
                        ", ".join(f"{c} elements" for c in cases)))
    report.write(table(rows, ["case", "contender", "ms", "GB/s", "of copy", "vs torch",
                              "graph replay / call", "target"]))
    report.write("\nGB/s counts the bytes read + written; `vs torch` is torch's time over the "
                 "row's (above 1: faster than torch). Targets (issue 24): 8x16M ≥ 0.85 of copy "
                 "and ≥ 1.0x torch; 2000x4K ≥ 1.0x torch (eager, host included).\n")


# ---- optimizer steps

def gpt2_medium_shapes(d=1024, layers=24, vocab=50257, positions=1024, ff=4096):
    out = [(vocab, d), (positions, d)]
    for _ in range(layers):
        out += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,),  # ln_1, attention
                (d,), (d,), (d, ff), (ff,), (ff, d), (d,)]  # ln_2, MLP
    return out + [(d,), (d,)]


def lean_optimizer(name, fp32, grads32, low):
    """A FusedAdam with LEAN[name]'s storage over ``low`` copies of ``fp32`` holding ``grads32``
    (left scaled by the step): (it, the bytes a parameter's step moves)."""
    kw, nbytes = LEAN[name]
    model = [p.to(low).requires_grad_() for p in fp32]
    for p, gr in zip(model, grads32):
        p.grad = gr.to(low)
    return FusedAdam(model, lr=1e-4, weight_decay=0.01, adam_w_mode=True,
                     store_unscaled_grads=False, **kw), nbytes


def bench_optimizer(args, clock, report):
    dev = args.device
    shapes = gpt2_medium_shapes() if not args.tiny else gpt2_medium_shapes(64, 2, 1000, 64, 256)
    low = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    fp32 = [torch.randn(s, generator=g, device=dev).mul_(0.02) for s in shapes]
    n = sum(p.numel() for p in fp32)
    grads32 = [torch.randn(p.shape, generator=g, device=dev).mul_(1e-3) for p in fp32]
    scale = torch.ones(1, device=dev)
    found = torch.zeros(1, device=dev)
    contenders, nbytes, targets = {}, {}, {}

    # The amp O2 step as a user runs it (as bench_optimizers' AMP_ROW): scale_loss's exit (bf16:
    # a static scale of 1, nothing to check) and FusedAdam.step; the gradients a backward would
    # have written are put back before each call, untimed.
    row = "amp O2 step, FusedAdam (bf16 weights, fp32 masters + moments)"
    contenders[row] = (*amp_o2_step(fp32, grads32, low, dev), 1)
    nbytes[row] = 2 + 2 + 4 * 6  # grad r, weight w, master/m/v r+w (bf16: static scale 1)
    targets[row] = [("vs torch", ">=", 1.0), ("of copy", ">=", 0.80)]

    lean_targets = {"remainder + bf16 moments": 1.45, "remainder + 8-bit moments": 1.8}
    lean_opts = []
    for name, goal in lean_targets.items():
        o, b = lean_optimizer(name, fp32, grads32, low)
        lean_opts.append(o)
        row = f"lean: {name}"
        contenders[row] = (None, (lambda o: lambda: o.step(grad_scale=scale, found_inf=found))(o), 1)
        nbytes[row] = b
        targets[row] = [("vs torch", ">=", goal)]

    model32 = [p.clone().requires_grad_() for p in fp32]
    for p, gr in zip(model32, grads32):
        p.grad = gr.clone()
    fused = torch.optim.AdamW(model32, lr=1e-4, weight_decay=0.01, fused=True)
    torch_row = "torch AdamW(fused=True), fp32 weights"
    contenders[torch_row] = (None, fused.step, 1)
    nbytes[torch_row] = 4 + 8 * 3
    targets[torch_row] = []

    times = clock.interleaved(contenders, args.repeats)
    del contenders
    t_copy = copy_seconds(clock, n * 28, dev, args.repeats)
    copy_gbs = n * 28 / t_copy / 1e9
    rows = []
    for name, t in times.items():
        gbs = n * nbytes[name] / t / 1e9
        values = {"vs torch": times[torch_row] / t, "of copy": gbs / copy_gbs}
        met = []
        for key, op, goal in targets[name]:
            target, outcome = verdict(values[key], op, goal)
            met.append(f"{key} {target}: {outcome}")
        rows.append([name, f"{t * 1e3:.2f}", f"{nbytes[name]:.4g}", f"{gbs:.0f}",
                     f"{values['of copy']:.2f}", f"{values['vs torch']:.2f}x", "; ".join(met)])
    rows.append(["D2D copy (28 B/param)", f"{t_copy * 1e3:.2f}", "", f"{copy_gbs:.0f}", "1.00",
                 "", ""])
    report.write(header(args, "One optimizer step, GPT-2-medium shapes",
                        f"{n / 1e6:.1f}M parameters in {len(shapes)} tensors"))
    report.write(table(rows, ["contender", "ms/step", "B/param", "GB/s", "of copy",
                              "vs torch", "target"]))
    report.write("\nB/param: bytes each step must read + write per parameter (lean rows: "
                 "gradients left scaled, as in benchmarks/bench_optimizers.py). `vs torch`: "
                 "torch's time over the row's. Targets (issue 24): amp O2 ≥ 1.0x and ≥ 0.80 of "
                 "copy; remainders + bf16 moments ≥ 1.45x; remainders + 8-bit moments ≥ 1.8x.\n")
    del lean_opts, fused, model32, fp32, grads32  # (the amp step went with the contenders)
    if dev == "cuda":
        torch.cuda.empty_cache()


# ---- a whole training step of GPT-2 small

def bench_training(args, clock, report, deadline):
    from transformers import GPT2Config, GPT2LMHeadModel

    dev = args.device
    if args.tiny:
        config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64)
        batch, seq = 2, 32
    else:
        config = GPT2Config()  # GPT-2 small: 124M parameters
        batch, seq = 8, 1024
    # Dropout stays at the config's defaults (a training step); attention through SDPA.
    torch.manual_seed(0)
    with torch.device(dev):  # initialised on the device: seconds less per copy on a GPU
        base = GPT2LMHeadModel(config)
    base.train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=dev)
    nparams = sum(p.numel() for p in base.parameters())

    def fresh():
        with torch.device(dev):
            m = GPT2LMHeadModel(config)
        m.load_state_dict(base.state_dict())
        m.train()
        return m

    def torch_step(model, opt):
        def step():
            with torch.autocast(dev, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    def amp_step(model, opt):
        def step():
            loss = model(input_ids=ids, labels=ids).loss
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    rounds = args.repeats
    sizes = (f"GPT-2 {'(tiny config)' if args.tiny else 'small'} {nparams / 1e6:.{0 if nparams > 1e7 else 2}f}M params, "
             f"batch {batch}, sequence {seq}, bf16, eager unless named")
    rows = []
    TORCH = "torch.autocast + AdamW(fused=True)"

    # Phase 1: amp O2 + FusedAdam against torch (O2 casts only its own model: the torch model
    # in the same process is untouched).
    m_torch = fresh()
    o_torch = torch.optim.AdamW(m_torch.parameters(), lr=1e-4, fused=True)
    m_o2 = fresh()
    m_o2, o_o2 = amp.initialize(m_o2, FusedAdam(m_o2.parameters(), lr=1e-4, adam_w_mode=True),
                                opt_level="O2", low_precision_dtype=torch.bfloat16, verbosity=0)
    times = clock.interleaved({TORCH: (None, torch_step(m_torch, o_torch), 1),
                               "amp O2 + FusedAdam": (None, amp_step(m_o2, o_o2), 1)}, rounds)
    r = times["amp O2 + FusedAdam"] / times[TORCH]
    rows.append(["O2 vs torch", "amp O2 + FusedAdam", f"{times['amp O2 + FusedAdam'] * 1e3:.1f}",
                 f"{times[TORCH] * 1e3:.1f}", f"{r:.3f}x", "{}: {}".format(*verdict(r, "<=", 0.95))])
    del m_o2, o_o2
    if dev == "cuda":
        torch.cuda.empty_cache()

    # Phase 2: amp O1 against torch. O1's caster is global while it is on (as Apex's patching
    # was), so the torch contender runs inside amp.disable_casts(): torch's autocast alone.
    m_o1 = fresh()
    o_o1 = torch.optim.AdamW(m_o1.parameters(), lr=1e-4, fused=True)
    m_o1, o_o1 = amp.initialize(m_o1, o_o1, opt_level="O1", low_precision_dtype=torch.bfloat16,
                                verbosity=0)
    plain = torch_step(m_torch, o_torch)

    def torch_without_o1():
        with amp.disable_casts():
            plain()
    times = clock.interleaved({TORCH: (None, torch_without_o1, 1),
                               "amp O1 + AdamW(fused=True)": (None, amp_step(m_o1, o_o1), 1)},
                              rounds)
    r = times["amp O1 + AdamW(fused=True)"] / times[TORCH]
    rows.append(["O1 vs torch", "amp O1 + AdamW(fused=True)",
                 f"{times['amp O1 + AdamW(fused=True)'] * 1e3:.1f}", f"{times[TORCH] * 1e3:.1f}",
                 f"{r:.3f}x", "{}: {}".format(*verdict(r, "<=", 1.05))])
    # Switches O1 off before anything else runs (initialize(enabled=False) resets the global
    # state).
    amp.initialize(torch.nn.Linear(1, 1), enabled=False, verbosity=0)
    del m_o1, o_o1
    if dev == "cuda":
        torch.cuda.empty_cache()

    columns = ["pair", "contender", "ms/step", "torch ms/step", "time ratio", "target"]
    report.write(header(args, "One training step, GPT-2 small, bf16", sizes))
    report.write(table(rows, columns))
    report.write("\nA step: forward with the loss, backward, optimizer step, zero_grad "
                 "(set_to_none). `time ratio`: the row's time over torch's, measured "
                 "interleaved in the same pair (below 1: faster). Targets (issue 24): O2 ≤ 0.95x, "
                 "O1 ≤ 1.05x.\n")
    rows = []

    # Phase 3 (no target): torch.compile'd model, if the budget allows its compile time (the
    # table above is written first: a run stopped while compiling keeps it).
    left = deadline - time.monotonic()
    want = args.compile == "on" or (args.compile == "auto" and left > (90 if args.tiny else 100))
    if want:
        m_c = fresh()
        o_c = torch.optim.AdamW(m_c.parameters(), lr=1e-4, fused=True)
        compiled = torch.compile(m_c)
        t0 = time.monotonic()
        step_c = torch_step(compiled, o_c)
        step_c()
        clock.sync()
        compile_s = time.monotonic() - t0
        times = clock.interleaved({TORCH: (None, plain, 1),
                                   "torch.compile + autocast + AdamW(fused=True)":
                                       (None, step_c, 1)}, rounds)
        name = "torch.compile + autocast + AdamW(fused=True)"
        r = times[name] / times[TORCH]
        rows.append(["compiled (no target)", name, f"{times[name] * 1e3:.1f}",
                     f"{times[TORCH] * 1e3:.1f}", f"{r:.3f}x",
                     f"first step (compile) {compile_s:.0f} s"])
        del m_c, o_c, compiled
    else:
        why = ("--compile off" if args.compile == "off" else
               f"{left:.0f} s left of the budget (--compile on forces it)")
        rows.append(["compiled (no target)", "torch.compile", "skipped", "", "", why])
    report.write("\n" + table(rows, columns))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="toy sizes (the dry run on a CPU)")
    parser.add_argument("--out", default=None, help="markdown file to append the tables to")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--repeats", type=int, default=None,
                        help="interleaved rounds (default 15 on a GPU, 3 with --tiny)")
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                        help="the torch.compile row: auto = only if --deadline-s leaves time")
    parser.add_argument("--deadline-s", type=float, default=120.0,
                        help="seconds this run may take; the optional rows are skipped past it")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.deadline_s
    if args.repeats is None:
        args.repeats = 3 if args.tiny else 15
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu: --device cuda but torch sees no CUDA device")
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    clock = Clock(args.device)
    report = Report(args.out)
    failed = 0
    for section in sections:
        t0 = time.monotonic()
        try:
            {"unscale": bench_unscale, "optimizer": bench_optimizer,
             "training": lambda a, c, r: bench_training(a, c, r, deadline)}[section](
                 args, clock, report)
        except Exception as e:  # one failing section must not lose the others' tables
            import traceback
            failed += 1
            report.write(f"\n### {section}: FAILED\n\n```\n{traceback.format_exc()[-3000:]}```\n")
            with contextlib.suppress(Exception):
                if args.device == "cuda":
                    torch.cuda.empty_cache()
        report.write(f"\n({section}: {time.monotonic() - t0:.1f} s)\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
