"""A small decoder-only transformer language model trained with peak.amp in bf16 (or fp16).

The text ships with Python: the source of a standard-library module (``argparse`` by default), read
character by character, so nothing is downloaded.  Shows:

* bf16 mixed precision at O1 (fp32 weights, low-precision matmuls) or O2 (bf16 weights, fp32 master
  weights), one flag apart; fp16 works too (``--dtype fp16``, dynamic loss scaling);
* gradient accumulation: ``--accum-steps N`` micro-batches per optimizer step, each loss divided by N and
  passed through its own ``amp.scale_loss`` (peak unscales each backward pass and adds it to the earlier
  ones); ``--delay-unscale`` instead leaves the gradients scaled until the last micro-batch (Apex's
  ``delay_unscale=True`` optimization);
* gradient clipping on ``amp.master_params(optimizer)`` -- the fp32 masters under O2, the model's
  parameters otherwise -- after the last ``scale_loss`` of the step, when the gradients are unscaled.

    python examples/transformer_lm/train.py --opt-level O2 --dtype bf16 --steps 300
    python examples/transformer_lm/train.py --opt-level O1 --accum-steps 4 --clip-grad 1.0
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from peak import amp

try:
    from tqdm import tqdm
except ImportError:  # the progress bar is optional
    def tqdm(iterable, **_):
        return iterable
    tqdm.write = print


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="char-level transformer LM with peak.amp")
    p.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"], help="the low-precision dtype")
    p.add_argument("--text-module", default="argparse", help="train on this stdlib module's source")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    p.add_argument("--accum-steps", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--delay-unscale", action="store_true", help="unscale once per step, not per micro-batch")
    p.add_argument("--clip-grad", type=float, default=1.0, help="max gradient norm (0: no clipping)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--print-freq", type=int, default=25)
    p.add_argument("--sample-chars", type=int, default=120, help="characters to generate at the end")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p.parse_args(argv)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab, context, d, layers, heads):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def load_text(module_name):
    return inspect.getsource(importlib.import_module(module_name))


def batches(data, context, batch_size, g):
    starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=g)
    x = torch.stack([data[s:s + context] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + context + 1] for s in starts.tolist()])
    return x, y


@torch.no_grad()
def evaluate(model, data, context, device, n=8):
    g = torch.Generator().manual_seed(1234)
    model.eval()
    x, y = batches(data, context, n * 4, g)
    logits = model(x.to(device))
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten())
    model.train()
    return loss.item()


@torch.no_grad()
def sample(model, prompt, n, context, device):
    model.eval()
    idx = prompt.to(device).view(1, -1)
    for _ in range(n):
        logits = model(idx[:, -context:])[:, -1].float()
        idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    model.train()
    return idx[0, prompt.numel():].tolist()


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    text = load_text(args.text_module)
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]

    model = TinyGPT(len(chars), args.context, args.d_model, args.n_layers, args.n_heads).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    low = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,  # amp
                                      low_precision_dtype=low, verbosity=0)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, cosine decay
        optimizer, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    print(f"{args.text_module}.py: {len(text)} characters, {len(chars)} distinct; model "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params; {args.opt_level} {args.dtype}, "
          f"{args.accum_steps} micro-batches of {args.batch_size}x{args.context} tokens per step")

    g = torch.Generator().manual_seed(args.seed)
    tokens_per_step = args.accum_steps * args.batch_size * args.context
    t0 = time.perf_counter()
    bar = tqdm(range(args.steps), desc=f"lm {args.opt_level} {args.dtype}", disable=args.no_progress)
    for step in bar:
        optimizer.zero_grad()
        step_loss = 0.0
        for micro in range(args.accum_steps):
            x, y = batches(train_data, args.context, args.batch_size, g)
            x, y = x.to(device), y.to(device)
            # .float(): the loss in fp32 at every opt_level (O2/O3 models already return fp32; peak's
            # interim O1 caster covers only the model's forward, so its logits come out in low precision)
            logits = model(x).float()
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / args.accum_steps
            last = micro == args.accum_steps - 1
            with amp.scale_loss(loss, optimizer,  # amp: each micro-batch adds its unscaled gradients
                                delay_unscale=args.delay_unscale and not last) as scaled_loss:
                scaled_loss.backward()
            step_loss += loss.item()
        if args.clip_grad > 0:  # amp: clip what the optimizer steps (fp32 masters under O2), once unscaled
            grad_norm = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), args.clip_grad)
        else:
            grad_norm = torch.zeros(())
        optimizer.step()
        schedule.step()
        if step % args.print_freq == 0 or step == args.steps - 1:
            if device.type == "cuda":
                torch.cuda.synchronize()
            speed = (step + 1) * tokens_per_step / (time.perf_counter() - t0)
            tqdm.write(f"step {step}  loss {step_loss:.4f}  grad_norm {grad_norm.item():.3f}  "
                       f"loss_scale {amp._amp_state.loss_scalers[0].loss_scale():g}  "
                       f"throughput {speed:.0f} tok/s")
    val = evaluate(model, val_data, args.context, device)
    print(f"validation loss {val:.4f} (uniform guess: {math.log(len(chars)):.4f}); "
          f"{args.steps * tokens_per_step / (time.perf_counter() - t0):.0f} tokens/s")
    if args.sample_chars:
        prompt = data[split:split + args.context // 2]
        out = sample(model, prompt, args.sample_chars, args.context, device)
        print("sample:", repr("".join(chars[i] for i in prompt.tolist()) + "|" + "".join(chars[i] for i in out)))


if __name__ == "__main__":
    main()
