"""Training loops for the fault-injection tests: a small model under peak.amp.GradScaler, with
inf/NaN injected (seeded) into random gradient elements or the loss at random steps; the same loop
without poison that skips the same steps by construction; checkpoints for the SIGKILL test.

Also runnable as a script (the SIGKILL test's child process):
    python fault_helpers.py CONFIG STEPS CKPT_PATH OUT_PATH [SLOW_AFTER]
trains CONFIG for STEPS steps (resuming from CKPT_PATH when it exists), writing CKPT_PATH atomically
after every step and the final state to OUT_PATH."""

from __future__ import annotations

import os
import random
import sys
import time

if __name__ == "__main__":  # the SIGKILL test's child: tests/ (peak_testing) is not on its path
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from peak_testing import bitwise_equal, make_mlp, regression_batch, state_tensors  # noqa: E402

# name -> (model dtype, autocast dtype or None, optimizer)
CONFIGS = {
    "f16model-FusedAdam": (torch.float16, None, "fused_adam"),
    "bf16model-FusedAdam": (torch.bfloat16, None, "fused_adam"),
    "f32-autocast-f16-Adam": (torch.float32, torch.float16, "adam"),
    "bf16model-FusedSGD": (torch.bfloat16, None, "fused_sgd"),
    # the Apex dialect: amp.initialize(opt_level="O2") with its own loss scaler
    "amp-O2-f16-SGD": ("amp-O2", torch.float16, "sgd"),
    "amp-O2-f16-FusedAdam": ("amp-O2", torch.float16, "fused_adam"),
}


def is_amp(config):
    return CONFIGS[config][0] == "amp-O2"


def get_scale(scaler):
    return scaler.loss_scale() if hasattr(scaler, "loss_scale") else scaler.get_scale()


def set_scale(scaler, value):
    if hasattr(scaler, "loss_scale"):
        scaler._loss_scale = value
    else:
        scaler.scale(torch.zeros(()))  # creates the scale lazily if step 0 is "skipped"
        scaler.update(value)
KINDS = ("grad_inf", "grad_nan", "loss_inf", "loss_nan")
INIT_SCALE, GROWTH_INTERVAL, MAX_SCALE = 2.0 ** 10, 10, 2.0 ** 14


def poison_plan(steps: int, seed: int, rate: float = 0.05) -> dict:
    """{step: (kind, which parameter, which element as a fraction)} for about ``rate`` of steps."""
    rng = random.Random(seed)
    plan = {}
    for s in range(steps):
        if rng.random() < rate:
            plan[s] = (rng.choice(KINDS), rng.randrange(4), rng.random())
    return plan


def expected_scales(steps: int, plan: dict) -> list:
    """The scale after each step's update: halve on a poisoned step, double (up to MAX_SCALE)
    after GROWTH_INTERVAL clean steps in a row."""
    scale, tracker, out = INIT_SCALE, 0, []
    for s in range(steps):
        if s in plan:
            scale, tracker = scale * 0.5, 0
        else:
            tracker += 1
            if tracker == GROWTH_INTERVAL:
                scale, tracker = min(scale * 2.0, MAX_SCALE), 0
        out.append(scale)
    return out


def build(config: str):
    import peak.optimizers
    from peak import amp

    model_dtype, low, opt_name = CONFIGS[config]
    model = make_mlp(0, 8, 4, hidden=16)
    if not is_amp(config):
        model = model.to(model_dtype)
    if opt_name == "fused_adam":
        opt = peak.optimizers.FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01, adam_w_mode=True)
    elif opt_name == "fused_sgd":
        opt = peak.optimizers.FusedSGD(model.parameters(), lr=1e-2, momentum=0.9)
    elif opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if is_amp(config):
        model, opt = amp.initialize(model, opt, opt_level="O2", low_precision_dtype=low, loss_scale="dynamic",
                                    max_loss_scale=MAX_SCALE, verbosity=0)
        scaler = amp._amp_state.loss_scalers[0]
        scaler._loss_scale = INIT_SCALE
        scaler.growth_interval = GROWTH_INTERVAL
        return model, opt, scaler
    scaler = amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, max_scale=MAX_SCALE)
    return model, opt, scaler


def batch(step: int):
    return regression_batch(step, 16, 8, 4)


def all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t.float()).all()) for t in tensors)


def train_step(model, opt, scaler, config, step, poison=None, new_scale=None):
    """One step; ``poison`` = (kind, param index, element fraction) injects a fault;
    ``new_scale``: the by-construction run sets the scale instead of letting update() decide."""
    from peak import amp

    _, low, _ = CONFIGS[config]
    x, y = batch(step)
    opt.zero_grad(set_to_none=True)
    if is_amp(config):
        loss = torch.nn.functional.mse_loss(model(x), y)
        kind = poison[0] if poison else None
        if kind in ("loss_inf", "loss_nan"):
            loss = loss * float("inf" if kind == "loss_inf" else "nan")
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            if kind in ("grad_inf", "grad_nan"):  # before scale_loss's exit checks it
                flat = list(model.parameters())[poison[1]].grad.view(-1)
                flat[int(poison[2] * flat.numel())] = float("inf") if kind == "grad_inf" else float("nan")
        opt.step()
        if new_scale is not None:
            set_scale(scaler, new_scale)
        return
    with amp.autocast("cpu", dtype=low or torch.bfloat16, enabled=low is not None):
        out = model(x.to(next(model.parameters()).dtype))
    loss = torch.nn.functional.mse_loss(out.float(), y)
    kind = poison[0] if poison else None
    if kind == "loss_inf":
        loss = loss * float("inf")
    elif kind == "loss_nan":
        loss = loss * float("nan")
    scaler.scale(loss).backward()
    if kind in ("grad_inf", "grad_nan"):
        grad = list(model.parameters())[poison[1]].grad
        flat = grad.view(-1)
        flat[int(poison[2] * flat.numel())] = float("inf") if kind == "grad_inf" else float("nan")
    scaler.step(opt)
    scaler.update(new_scale)


def run(config: str, steps: int, plan: dict, *, by_construction: bool = False, check_every_step=True):
    """The poisoned run (``by_construction=False``) or the clean run that skips the steps of
    ``plan`` itself and sets the scales ``expected_scales`` predicts.  Returns
    (final state, scales, skipped flags, first non-finite step or None)."""
    model, opt, scaler = build(config)
    expect = expected_scales(steps, plan)
    scales, skipped, bad_step = [], [], None
    for s in range(steps):
        if by_construction:
            if s not in plan:
                train_step(model, opt, scaler, config, s, new_scale=expect[s])
            else:
                set_scale(scaler, expect[s])
            skipped.append(s in plan)
        else:
            before = state_tensors(model, opt) if is_amp(config) else None
            train_step(model, opt, scaler, config, s, plan.get(s))
            if before is not None:  # amp has no last_step_skipped: nothing changed = skipped
                skipped.append(bitwise_equal(before, state_tensors(model, opt)))
            else:
                skipped.append(scaler.last_step_skipped)
        scales.append(get_scale(scaler))
        if check_every_step and bad_step is None and not all_finite(state_tensors(model, opt)):
            bad_step = s
    return state_tensors(model, opt), scales, skipped, bad_step


def _atomic_save(obj, path, pause=0.0):
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    time.sleep(pause)
    os.replace(tmp, path)


def main(config, steps, ckpt_path, out_path, slow_after=None):
    """``slow_after``: from that step on, each checkpoint waits 50 ms between writing its file and
    putting it in place (the SIGKILL test's window: a parent that lost the CPU for a moment still
    kills a run in progress, most likely mid-save, where an unsafe save would show)."""
    torch.set_num_threads(1)
    plan = poison_plan(steps, seed=7)
    model, opt, scaler = build(config)
    start = 0
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        scaler.load_state_dict(ck["scaler"])
        start = ck["step"]
        print(f"resumed {start}", flush=True)
    for s in range(start, steps):
        train_step(model, opt, scaler, config, s, plan.get(s))
        pause = 0.05 if slow_after is not None and s >= slow_after else 0.0
        _atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                      "step": s + 1}, ckpt_path, pause)
        print(f"step {s + 1}", flush=True)
    torch.save({"state": state_tensors(model, opt), "scale": scaler.get_scale()}, out_path)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4],
         int(sys.argv[5]) if len(sys.argv) > 5 else None)
