"""DCGAN with peak.amp: two models, two optimizers, three losses -- the case Apex's docs promised
("a comprehensive DCGAN example is under construction") and never shipped.

Runs on CPU or CUDA with synthetic images (soft round blobs at random places and sizes), no downloads:

    python examples/dcgan/main_amp.py --opt-level O1 --dtype bf16 --steps 200
    python examples/dcgan/main_amp.py --opt-level O2 --dtype fp16 --device cuda --image-size 32

What GANs need, and where it happens below (lines marked "# amp"):

1. One `amp.initialize` call for both models and both optimizers, with `num_losses=3`: each of the
   three backward passes (D on real, D on fake, G through D) gets its own loss scaler (`loss_id`),
   because their gradients have very different magnitudes; an overflow in one must not shrink the
   scale of the others.
2. Each `scale_loss` names only the optimizer that will step on those gradients, so an overflow skips
   exactly that optimizer's next step.
3. D's update sees `fake.detach()`: no gradients flow into G (G is stepped separately).
4. G's update back-propagates *through* D; D's parameters are frozen for it (`requires_grad_(False)`),
   so no gradient of D's is computed, scaled by G's scaler and left behind for D's next step.
5. D's two losses accumulate into one step: the second `scale_loss` adds its unscaled gradients to
   those of the first (peak unscales every backward pass separately, so two scalers can share a step).
6. The losses are computed in fp32 from logits with `BCEWithLogitsLoss` (plain `BCELoss` after a
   sigmoid is not safe in fp16; Apex's O1 and torch.autocast both refuse it).  The `.float()` is a
   no-op at O0/O2/O3 (amp models return fp32); peak's interim O1 caster covers only the models'
   forward, so under O1 the logits come out in low precision.
"""
from __future__ import annotations

import argparse
import math
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
    p = argparse.ArgumentParser(description="DCGAN on synthetic images with peak.amp")
    p.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3"])
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"], help="the low-precision dtype")
    p.add_argument("--loss-scale", default=None, help="a number (static) or 'dynamic'")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=16, choices=[16, 32, 64])
    p.add_argument("--nz", type=int, default=32, help="size of the latent vector")
    p.add_argument("--ngf", type=int, default=32)
    p.add_argument("--ndf", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--beta1", type=float, default=0.5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--print-freq", type=int, default=20)
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p.parse_args(argv)


def generator(nz, ngf, size):
    n_up = int(math.log2(size)) - 3  # 4x4 -> size/2 by stride-2 transposed convs, then the output layer
    layers = [nn.ConvTranspose2d(nz, ngf * 2**n_up, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2**n_up), nn.ReLU(True)]
    for i in range(n_up, 0, -1):
        layers += [nn.ConvTranspose2d(ngf * 2**i, ngf * 2**(i - 1), 4, 2, 1, bias=False),
                   nn.BatchNorm2d(ngf * 2**(i - 1)), nn.ReLU(True)]
    layers += [nn.ConvTranspose2d(ngf, 1, 4, 2, 1, bias=False), nn.Tanh()]
    return nn.Sequential(*layers)


def discriminator(ndf, size):
    n_down = int(math.log2(size)) - 3
    layers = [nn.Conv2d(1, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, True)]
    for i in range(n_down):
        layers += [nn.Conv2d(ndf * 2**i, ndf * 2**(i + 1), 4, 2, 1, bias=False),
                   nn.BatchNorm2d(ndf * 2**(i + 1)), nn.LeakyReLU(0.2, True)]
    layers += [nn.Conv2d(ndf * 2**n_down, 1, 4, 1, 0, bias=False), nn.Flatten()]  # one logit per image
    return nn.Sequential(*layers)


def init_weights(m):
    if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif isinstance(m, nn.BatchNorm2d):
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


def real_batch(step, batch_size, size, seed):
    """Soft round blobs in [-1, 1]: random centre, radius and brightness (a batch depends only on step)."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    centre = torch.rand(batch_size, 2, 1, 1, generator=g) * 0.6 + 0.2
    radius = torch.rand(batch_size, 1, 1, 1, generator=g) * 0.15 + 0.1
    peak = torch.rand(batch_size, 1, 1, 1, generator=g) * 0.5 + 0.5
    axis = (torch.arange(size) + 0.5) / size
    d2 = (axis.view(1, 1, 1, -1) - centre[:, :1]) ** 2 + (axis.view(1, 1, -1, 1) - centre[:, 1:]) ** 2
    blob = peak * torch.exp(-d2 / (2 * radius**2))
    return (2 * blob - 1).view(batch_size, 1, size, size)


def moment_gap(fake, real):
    """How far the generated images are from the real ones in per-pixel mean and std (0 = same)."""
    fake, real = fake.float(), real.float()
    return ((fake.mean(0) - real.mean(0)).abs().mean() + (fake.std(0) - real.std(0)).abs().mean()).item()


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    netG = generator(args.nz, args.ngf, args.image_size).to(device)
    netD = discriminator(args.ndf, args.image_size).to(device)
    netG.apply(init_weights)
    netD.apply(init_weights)
    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))

    low = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    [netD, netG], [optimizerD, optimizerG] = amp.initialize(  # amp: both models, both optimizers,
        [netD, netG], [optimizerD, optimizerG], opt_level=args.opt_level,  # one scaler per loss
        loss_scale=args.loss_scale, num_losses=3, low_precision_dtype=low)
    criterion = nn.BCEWithLogitsLoss()
    fixed_noise = torch.randn(256, args.nz, 1, 1, device=device)
    eval_real = real_batch(-1, 256, args.image_size, args.seed).to(device)

    t0 = time.perf_counter()
    bar = tqdm(range(args.steps), desc=f"dcgan {args.opt_level} {args.dtype}", disable=args.no_progress)
    for step in bar:
        real = real_batch(step, args.batch_size, args.image_size, args.seed).to(device)
        b = real.shape[0]
        ones = torch.ones(b, 1, device=device)
        zeros = torch.zeros(b, 1, device=device)

        # (1) update D: maximize log(D(x)) + log(1 - D(G(z)))
        optimizerD.zero_grad()
        errD_real = criterion(netD(real).float(), ones)
        with amp.scale_loss(errD_real, optimizerD, loss_id=0) as errD_real_scaled:  # amp
            errD_real_scaled.backward()
        noise = torch.randn(b, args.nz, 1, 1, device=device)
        fake = netG(noise)
        errD_fake = criterion(netD(fake.detach()).float(), zeros)
        with amp.scale_loss(errD_fake, optimizerD, loss_id=1) as errD_fake_scaled:  # amp: adds to D's grads
            errD_fake_scaled.backward()
        optimizerD.step()

        # (2) update G: maximize log(D(G(z))), back-propagating through a frozen D
        optimizerG.zero_grad()
        netD.requires_grad_(False)
        errG = criterion(netD(fake).float(), ones)
        with amp.scale_loss(errG, optimizerG, loss_id=2) as errG_scaled:  # amp
            errG_scaled.backward()
        netD.requires_grad_(True)
        optimizerG.step()

        if step % args.print_freq == 0 or step == args.steps - 1:
            with torch.no_grad():
                netG.eval()
                gap = moment_gap(netG(fixed_noise), eval_real)
                netG.train()
            if device.type == "cuda":
                torch.cuda.synchronize()
            speed = (step + 1) * args.batch_size / (time.perf_counter() - t0)
            scales = " ".join(f"{s.loss_scale():g}" for s in amp._amp_state.loss_scalers)
            tqdm.write(f"step {step}  loss_D {(errD_real + errD_fake).item():.4f}  loss_G {errG.item():.4f}  "
                       f"moment_gap {gap:.4f}  loss_scales {scales}  throughput {speed:.1f} img/s")
    print(f"done: {args.steps} steps, {args.steps * args.batch_size / (time.perf_counter() - t0):.1f} img/s, "
          f"amp state {({k: dict(v) for k, v in amp.state_dict().items()})}")


if __name__ == "__main__":
    main()
