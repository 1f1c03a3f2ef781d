"""peak's main job in one command (`make demo`): train a small CNN with batch norm under every
opt_level, in fp16 and bf16, and print what happened.

Each run starts from the same weights and sees the same synthetic batches (a 10-class problem
whose labels depend on the images, so the loss really falls). The table shows the final loss,
the mean step time, the loss scale at the end and how many steps the dynamic loss scaler
skipped because of an overflow.

    python examples/demo.py [--steps 60] [--device cpu|cuda] [--batch-size 64]
"""
import argparse
import copy
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from peak import amp


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


def train(base_model, batches, opt_level, dtype, device):
    model = copy.deepcopy(base_model).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    low = None if dtype == torch.float32 else dtype
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level,
                                      low_precision_dtype=low, verbosity=0)
    losses, times, skipped = [], [], 0
    for images, labels in batches:
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(images), labels)
        scale_before = amp._amp_state.loss_scalers[0].loss_scale()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        if amp._amp_state.loss_scalers[0].loss_scale() < scale_before:
            skipped += 1
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    final_scale = amp._amp_state.loss_scalers[0].loss_scale()
    tail = sum(losses[-5:]) / len(losses[-5:])
    return losses[0], tail, sum(times[2:]) / max(1, len(times) - 2), final_scale, skipped


def main():
    parser = argparse.ArgumentParser(description="Train a small CNN under O0-O3 with peak.amp")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    base_model = make_model()
    batches = make_batches(args.steps, args.batch_size, args.device)
    runs = [("O0", torch.float32)] + [(lvl, dt) for lvl in ("O1", "O2", "O3")
                                      for dt in (torch.float16, torch.bfloat16)]
    print(f"peak.amp demo: {args.steps} steps of SGD on a 3-conv CNN with batch norm, "
          f"batch {args.batch_size}, device {args.device}, torch {torch.__version__}")
    header = (f"{'opt_level':<10}{'dtype':<10}{'first loss':>11}{'final loss':>11}"
              f"{'ms/step':>9}{'loss scale':>12}{'skipped':>9}")
    print(header)
    print("-" * len(header))
    results = {}
    for opt_level, dtype in runs:
        first, final, step_s, scale, skipped = train(base_model, batches, opt_level, dtype,
                                                     args.device)
        results[(opt_level, dtype)] = final
        name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
        print(f"{opt_level:<10}{name:<10}{first:>11.4f}{final:>11.4f}{step_s * 1e3:>9.2f}"
              f"{scale:>12g}{skipped:>9d}")
    baseline = results[("O0", torch.float32)]
    worst = max(results.values())
    print(f"every run trained: final losses {min(results.values()):.3f}..{worst:.3f} "
          f"(O0 fp32: {baseline:.3f}); 'skipped' counts steps dropped for inf/NaN gradients")


if __name__ == "__main__":
    main()
