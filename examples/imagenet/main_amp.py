"""Mixed-precision training with peak.amp, in the shape of Apex's ImageNet example -- shrunk to a small
ResNet on synthetic data, so it runs anywhere (CPU or CUDA) with no downloads.

    python examples/imagenet/main_amp.py --opt-level O2 --dtype bf16 --steps 50
    python examples/imagenet/main_amp.py --opt-level O1 --steps 20 --save ckpt.pt
    python examples/imagenet/main_amp.py --opt-level O1 --steps 20 --resume ckpt.pt --epochs 2

The amp-specific lines are marked "# amp".
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from peak import amp

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is optional
    def tqdm(iterable, **_):
        return iterable
    tqdm.write = print


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="peak.amp synthetic-ImageNet example")
    p.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3"])
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"], help="the low-precision dtype")
    p.add_argument("--keep-batchnorm-fp32", default=None, choices=["True", "False"])
    p.add_argument("--loss-scale", default=None, help="a number (static) or 'dynamic'")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=20, help="steps per epoch")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--print-freq", type=int, default=5)
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--save", default=None, help="write a checkpoint here at the end")
    p.add_argument("--resume", default=None, help="continue from this checkpoint")
    return p.parse_args(argv)


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    def __init__(self, num_classes, width=16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = BasicBlock(width, width, 1)
        self.layer2 = BasicBlock(width, 2 * width, 2)
        self.layer3 = BasicBlock(2 * width, 4 * width, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


class SyntheticImages:
    """Each class has a fixed random image pattern; a sample is its class pattern plus noise."""

    def __init__(self, num_classes, image_size, seed):
        g = torch.Generator().manual_seed(seed)
        self.patterns = torch.randn(num_classes, 3, image_size, image_size, generator=g)
        self.seed = seed

    def batch(self, global_step, batch_size):
        g = torch.Generator().manual_seed(self.seed * 100003 + global_step)  # depends only on the step
        labels = torch.randint(0, self.patterns.shape[0], (batch_size,), generator=g)
        images = 0.5 * self.patterns[labels] + torch.randn(batch_size, *self.patterns.shape[1:], generator=g)
        return images, labels


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = SmallResNet(args.num_classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    low = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    model, optimizer = amp.initialize(  # amp
        model, optimizer, opt_level=args.opt_level, keep_batchnorm_fp32=args.keep_batchnorm_fp32,
        loss_scale=args.loss_scale, low_precision_dtype=low)
    criterion = nn.CrossEntropyLoss()
    data = SyntheticImages(args.num_classes, args.image_size, args.seed)

    start_epoch = 0
    if args.resume:  # load after amp.initialize, as the amp docs recommend
        ckpt = torch.load(args.resume, map_location=device, weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        amp.load_state_dict(ckpt["amp"])  # amp
        start_epoch = ckpt["epoch"]
        print(f"=> resumed from {args.resume} (epoch {start_epoch})")

    model.train()
    for epoch in range(start_epoch, args.epochs):
        seen, t0 = 0, time.perf_counter()
        bar = tqdm(range(args.steps), desc=f"epoch {epoch}", disable=args.no_progress, leave=False)
        for i in bar:
            global_step = epoch * args.steps + i
            images, labels = data.batch(global_step, args.batch_size)
            images, labels = images.to(device), labels.to(device)
            loss = criterion(model(images), labels)
            optimizer.zero_grad()
            with amp.scale_loss(loss, optimizer) as scaled_loss:  # amp
                scaled_loss.backward()
            optimizer.step()
            seen += args.batch_size
            if i % args.print_freq == 0 or i == args.steps - 1:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                speed = seen / (time.perf_counter() - t0)
                tqdm.write(f"Epoch: [{epoch}][{i}/{args.steps}]  step {global_step}  loss {loss.item():.6f}  "
                           f"throughput {speed:.1f} img/s")
        print(f"epoch {epoch} done: {seen} images, throughput {seen / (time.perf_counter() - t0):.1f} img/s, "
              f"loss scale {amp.state_dict().get('loss_scaler0', {}).get('loss_scale')}")

    if args.save:
        torch.save({"epoch": args.epochs, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "amp": amp.state_dict()}, args.save)  # amp
        print(f"=> saved checkpoint to {args.save}")


if __name__ == "__main__":
    main()
