"""The same training loop written for torch.amp and run on peak.amp: one import changes.

    python examples/torch_amp_migration.py                   # peak.amp  (from peak import amp)
    python examples/torch_amp_migration.py --dialect torch   # torch.amp (from torch import amp)
    python examples/torch_amp_migration.py --dtype bf16      # autocast to bf16, scaler disabled

The loop is torch's recipe (https://pytorch.org/docs/stable/amp.html): forward under ``autocast``,
``scaler.scale(loss).backward()``, ``scaler.unscale_`` before gradient clipping, ``scaler.step``,
``scaler.update``; checkpointing saves ``scaler.state_dict()``.  With ``--dialect peak`` the same
calls go to peak's ``GradScaler`` (its unscale and inf/NaN check are peak's multi-tensor kernels and
its loss-scale update is the one peak.amp's Apex dialect uses).  Both print the same numbers.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="one loop, torch.amp or peak.amp")
    p.add_argument("--dialect", default="peak", choices=["peak", "torch"])
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--init-scale", type=float, default=2.0**16, help="the scaler's first loss scale")
    p.add_argument("--print-freq", type=int, default=20)
    p.add_argument("--save", default=None, help="write model/optimizer/scaler state here at the end")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.dialect == "torch":
        from torch import amp
    else:
        from peak import amp  # the one line that changes

    device = args.device
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                          nn.Linear(256, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # bf16 has fp32's range: no loss scaling needed (a disabled scaler passes everything through)
    scaler = amp.GradScaler(device, init_scale=args.init_scale, enabled=dtype == torch.float16)

    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 10, generator=g)
    t0 = time.perf_counter()
    for step in range(args.steps):
        x = torch.randn(args.batch_size, 32, generator=g)
        y = (x @ teacher).argmax(1)
        x, y = x.to(device), y.to(device)

        optimizer.zero_grad(set_to_none=True)
        with amp.autocast(device, dtype=dtype):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)  # clip the true gradients
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        scaler.step(optimizer)  # skipped if the gradients held inf/NaN
        scaler.update()

        if step % args.print_freq == 0 or step == args.steps - 1:
            print(f"step {step}  loss {loss.item():.6f}  scale {scaler.get_scale():g}")
    elapsed = time.perf_counter() - t0
    print(f"{args.dialect}.amp {args.dtype}: {args.steps} steps in {elapsed:.2f} s "
          f"({args.steps * args.batch_size / elapsed:.0f} samples/s), final loss {loss.item():.6f}")
    if args.save:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict()}, args.save)
        print(f"saved {args.save}")


if __name__ == "__main__":
    main()
