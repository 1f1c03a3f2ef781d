"""peak's main job in one command (`make demo`): train a small CNN with batch norm under every
opt_level, in fp16 and bf16, print what happened and plot it.

Each run starts from the same weights and sees the same synthetic batches (a 10-class problem
whose labels depend on the images, so the loss really falls). The table shows the final loss,
the mean step time, the peak memory, the loss scale at the end and how many steps the dynamic
loss scaler skipped because of an overflow. A PNG with the loss curves and the loss-scale trace
of every run is written to --out (default demo_out/demo.png).

Peak memory: on CUDA, `torch.cuda.max_memory_allocated()` over the run. On the CPU torch keeps no
allocator statistics, so the column counts the bytes of every tensor alive at the end of the last
backward pass -- weights, gradients, fp32 master weights, optimizer state, buffers -- plus the
activations that pass saved for its backward. That is the part mixed precision changes.

fp16 arithmetic on the CPU is slow in PyTorch (convolutions take ~100x longer than in fp32), so
on the CPU the fp16 runs train for --fp16-steps steps (default 20); bf16 and fp32 runs, and every
run on CUDA, train for --steps.

    python examples/demo.py [--steps 60] [--fp16-steps 20] [--device cpu|cuda] [--batch-size 64]
                            [--out demo_out/demo.png]
"""
import argparse
import copy
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from peak import amp

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def make_model():
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def make_batches(steps, batch_size, device):
    g = torch.Generator().manual_seed(0)
    prototypes = torch.randn(10, 3, 16, 16, generator=g)
    batches = []
    for _ in range(steps):
        labels = torch.randint(0, 10, (batch_size,), generator=g)
        images = prototypes[labels] + 0.8 * torch.randn(batch_size, 3, 16, 16, generator=g)
        batches.append((images.to(device), labels.to(device)))
    return batches


class SavedActivations:
    """Records the storages autograd saves for backward (bytes, de-duplicated by storage)."""

    def __init__(self):
        self.storages = {}

    def pack(self, t):
        st = t.untyped_storage()
        self.storages[st.data_ptr()] = st.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def training_state_storages(model, optimizer):
    """{storage address: bytes} of the weights, buffers, gradients, masters and optimizer state."""
    out = {}

    def add(t):
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            out[st.data_ptr()] = st.nbytes()

    for p in list(model.parameters()) + list(model.buffers()):
        add(p)
        add(p.grad)
    for group in optimizer.param_groups:
        for p in group["params"]:
            add(p)
            add(p.grad)
    for state in optimizer.state.values():
        for v in state.values():
            add(v)
    return out


def train(base_model, batches, opt_level, dtype, device):
    """One run; returns per-step losses and loss scales, the mean step time (s), peak bytes, skips."""
    model = copy.deepcopy(base_model).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    low = None if dtype == torch.float32 else dtype
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level,
                                      low_precision_dtype=low, verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, scales, times, skipped, cpu_bytes = [], [], [], 0, 0
    for i, (images, labels) in enumerate(batches):
        last = i == len(batches) - 1
        saved = SavedActivations()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if last and device != "cuda":  # CPU memory: count what the last step holds (not timed)
            with saved.hooks():
                loss = F.cross_entropy(model(images), labels)
        else:
            loss = F.cross_entropy(model(images), labels)
        scale_before = scaler.loss_scale()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        if last and device != "cuda":
            cpu_bytes = sum({**saved.storages, **training_state_storages(model, optimizer)}.values())
        if scaler.loss_scale() < scale_before:
            skipped += 1
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if not last or device == "cuda":
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        scales.append(scaler.loss_scale())
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else cpu_bytes
    warm = times[2:] or times
    return dict(losses=losses, scales=scales, step_s=sum(warm) / max(1, len(warm)), peak_bytes=peak,
                skipped=skipped)


def plot(results, path, title):
    """Loss curves and loss-scale traces of every run in one PNG; returns the path or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {torch.float32: "-", torch.float16: "--", torch.bfloat16: ":"}
    colors = {"O0": "black", "O1": "tab:blue", "O2": "tab:orange", "O3": "tab:green"}
    for (opt_level, dtype), r in results.items():
        label = f"{opt_level} {DTYPE_NAMES[dtype]}"
        kw = dict(linestyle=styles[dtype], color=colors[opt_level], label=label)
        ax_loss.plot(range(len(r["losses"])), r["losses"], **kw)
        ax_scale.plot(range(len(r["scales"])), r["scales"], drawstyle="steps-post", **kw)
    ax_loss.set(xlabel="step", ylabel="training loss", yscale="log", title="loss")
    ax_scale.set(xlabel="step", ylabel="loss scale (after the step)", yscale="log", title="loss scale")
    ax_scale.set_yscale("log", base=2)
    ax_loss.legend(fontsize=8, ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description="Train a small CNN under O0-O3 with peak.amp")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--fp16-steps", type=int, default=None,
                        help="steps of the fp16 runs (default: 20 on the CPU, --steps on CUDA)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.path.join("demo_out", "demo.png"),
                        help="where to write the PNG ('' for none)")
    args = parser.parse_args(argv)
    fp16_steps = args.fp16_steps or (args.steps if args.device == "cuda" else min(args.steps, 20))

    torch.manual_seed(0)
    base_model = make_model()
    batches = make_batches(args.steps, args.batch_size, args.device)
    runs = [("O0", torch.float32)] + [(lvl, dt) for lvl in ("O1", "O2", "O3")
                                      for dt in (torch.float16, torch.bfloat16)]
    title = (f"peak.amp demo: SGD on a 3-conv CNN with batch norm, batch {args.batch_size}, "
             f"device {args.device}, torch {torch.__version__}")
    print(f"{title}\n{args.steps} steps ({fp16_steps} for fp16"
          f"{', which is slow on the CPU' if fp16_steps < args.steps else ''})")
    mem_note = "peak MB" if args.device == "cuda" else "mem MB*"
    header = (f"{'opt_level':<10}{'dtype':<7}{'steps':>6}{'first loss':>11}{'final loss':>11}"
              f"{'ms/step':>9}{mem_note:>9}{'loss scale':>12}{'skipped':>9}")
    print(header)
    print("-" * len(header))
    results = {}
    for opt_level, dtype in runs:
        n = fp16_steps if dtype == torch.float16 else args.steps
        r = train(base_model, batches[:n], opt_level, dtype, args.device)
        results[(opt_level, dtype)] = r
        tail = r["losses"][-5:]
        print(f"{opt_level:<10}{DTYPE_NAMES[dtype]:<7}{n:>6}{r['losses'][0]:>11.4f}{sum(tail) / len(tail):>11.4f}"
              f"{r['step_s'] * 1e3:>9.2f}{r['peak_bytes'] / 2**20:>9.2f}{r['scales'][-1]:>12g}"
              f"{r['skipped']:>9d}", flush=True)
    print("final loss: mean of the last 5 steps; 'skipped': steps dropped for inf/NaN gradients")
    if args.device != "cuda":
        print("* mem MB on the CPU: weights, grads, fp32 masters, optimizer state and saved activations at "
              "the end of the last backward (torch keeps no CPU allocator statistics)")
    if args.out:
        path = plot(results, args.out, title)
        if path:
            print(f"wrote {os.path.abspath(path)} (loss curves and loss-scale traces)")
    return results


if __name__ == "__main__":
    main()
