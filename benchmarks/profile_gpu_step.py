"""Where the time of one optimizer step goes on a GPU: the host's share and the device's.

    PYTHONPATH=build/gpu-check/pkg python3 benchmarks/profile_gpu_step.py --out profile.md

For bench_gpu.py's optimizer rows (GPT-2-medium shapes), per contender:
- host ms: the time step() takes to return (launches queued, not waited for), after a sync;
- event ms: CUDA events around one step, as bench_gpu.py times it;
- kernel ms: the sum of the step's kernels' device time (torch.profiler), and their count;
- host-device waits per step: synchronize and device-to-host copy calls the profiler saw;
- the host's Python: cProfile's top functions (own time) over a few steps.
When the event time is near the host time, the step is launch-bound (the host's Python sets the
pace); near the kernel time, the device does.
"""
import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import gpt2_medium_shapes, lean_optimizer  # noqa: E402
from bench_optimizers import amp_o2_step  # noqa: E402

WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
         "cudaMemcpy", "cudaMemcpyAsync", "aten::_local_scalar_dense", "aten::item")


def contenders(dev, tiny):
    shapes = gpt2_medium_shapes() if not tiny else gpt2_medium_shapes(64, 2, 1000, 64, 256)
    low = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    fp32 = [torch.randn(s, generator=g, device=dev).mul_(0.02) for s in shapes]
    grads32 = [torch.randn(p.shape, generator=g, device=dev).mul_(1e-3) for p in fp32]
    scale, found = torch.ones(1, device=dev), torch.zeros(1, device=dev)
    rows = {"amp O2 step, FusedAdam": amp_o2_step(fp32, grads32, low, dev)}
    for name in ("remainder + bf16 moments", "remainder + 8-bit moments"):
        o, _ = lean_optimizer(name, fp32, grads32, low)
        rows[f"lean: {name}"] = (None, (lambda o: lambda: o.step(grad_scale=scale,
                                                                 found_inf=found))(o))
    model32 = [p.clone().requires_grad_() for p in fp32]
    for p, gr in zip(model32, grads32):
        p.grad = gr.clone()
    rows["torch AdamW(fused=True)"] = (None, torch.optim.AdamW(model32, lr=1e-4,
                                                               weight_decay=0.01,
                                                               fused=True).step)
    return rows, len(shapes)


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def measure(dev, setup, fn, rounds):
    host, event = [], []
    for _ in range(rounds):
        if setup:
            setup()
        sync(dev)
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        sync(dev)
        if dev == "cuda":
            if setup:
                setup()
            sync(dev)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            event.append(a.elapsed_time(b) / 1e3)
    return statistics.median(host), (statistics.median(event) if event else float("nan"))


def profile(dev, setup, fn, steps):
    from torch.profiler import ProfilerActivity, profile as tprofile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    events = []
    for _ in range(steps):  # (the setup's copies outside the profile)
        if setup:
            setup()
        sync(dev)
        with tprofile(activities=acts) as prof:
            fn()
            sync(dev)
        events += prof.events()
    kernels, waits, names = 0.0, {}, {}
    count = 0
    for e in events:  # (a range named after the step, "Optimizer.step#...", is not a kernel)
        if (dev == "cuda" and e.device_type == torch.autograd.DeviceType.CUDA
                and "#" not in e.name):
            t = e.device_time if hasattr(e, "device_time") else e.cuda_time
            kernels += t
            count += 1
            names[e.name[:70]] = names.get(e.name[:70], 0.0) + t
        if e.name in WAITS:
            waits[e.name] = waits.get(e.name, 0) + 1
    top = sorted(names.items(), key=lambda kv: -kv[1])[:6]
    return kernels / steps / 1e3, count / steps, {k: v / steps for k, v in waits.items()}, top


def python_top(setup, fn, steps, n=14):
    pr = cProfile.Profile()
    for _ in range(steps):
        if setup:
            setup()
        pr.enable()
        fn()
        pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(n)
    return s.getvalue()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows, ntensors = contenders(args.device, args.tiny)
    lines = [f"# One optimizer step: host and device ({args.device}, "
             f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, torch "
             f"{torch.__version__}, {ntensors} tensors)\n",
             "| contender | host ms | event ms | kernel ms | kernels/step | waits/step |",
             "|---|---|---|---|---|---|"]
    tops, pys = [], []
    for name, (setup, fn) in rows.items():
        for _ in range(3):
            if setup:
                setup()
            fn()
        sync(args.device)
        host, event = measure(args.device, setup, fn, args.rounds)
        kern, count, waits, top = profile(args.device, setup, fn, 3)
        w = ", ".join(f"{k} {v:g}" for k, v in waits.items()) or "0"
        lines.append(f"| {name} | {host * 1e3:.2f} | {event * 1e3:.2f} | {kern:.2f} | "
                     f"{count:.0f} | {w} |")
        tops.append(f"\n### {name}: kernels (us per step)\n\n" + "\n".join(
            f"- {t / 3:.0f} {k}" for k, t in top))
        if not name.startswith("torch"):
            pys.append(f"\n### {name}: host Python (cProfile, 10 steps)\n\n```\n"
                       + python_top(setup, fn, 10) + "```\n")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n" + "\n".join(tops) + "\n" + "\n".join(pys)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
