"""Fault injection: inf/NaN written (seeded) into random gradient elements or the loss at random
steps of a GradScaler run (fp16/bf16 models with FusedAdam/FusedSGD, fp32 + fp16 autocast with
torch Adam) and of amp O2 runs (torch SGD with masters in param_groups, FusedAdam). Every poisoned step is skipped, nothing in the model or the optimizer (masters,
moments, step counters) ever becomes non-finite, the scale recovers, and the final state equals
bit for bit a clean run that skips the same steps by construction.  The default run is 300 steps
per configuration; the soak (``-m slow``) 2,000."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fault_helpers as F
from peak_testing import assert_bitwise_equal

CONFIGS = list(F.CONFIGS)


def _check(config, steps, seed):
    plan = F.poison_plan(steps, seed)
    assert len(plan) >= steps // 40 and {k for k, _, _ in plan.values()} == set(F.KINDS)
    state, scales, skipped, bad = F.run(config, steps, plan)
    ref_state, ref_scales, ref_skipped, ref_bad = F.run(config, steps, plan, by_construction=True)
    assert bad is None and ref_bad is None, f"non-finite state after step {bad}"
    assert skipped == [s in plan for s in range(steps)], "skipped steps differ from the poisoned ones"
    assert scales == F.expected_scales(steps, plan) == ref_scales
    low = min(range(steps), key=lambda s: (scales[s], s))
    assert max(scales[low:]) >= 4 * scales[low], "the scale never recovered from its lowest point"
    assert scales[-1] >= F.INIT_SCALE / 4
    assert_bitwise_equal(state, ref_state, f"{config} vs the reference: state tensors")
    return plan, steps - len(plan)


@pytest.mark.parametrize("config", CONFIGS)
def test_poisoned_run_equals_run_skipping_by_construction(config):
    _check(config, 300, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS)
def test_soak_2000_steps(config):
    _check(config, 2000, seed=2)


def test_fused_adam_step_counter_counts_only_taken_steps():
    steps = 120
    plan = F.poison_plan(steps, seed=3)
    model, opt, scaler = F.build("bf16model-FusedAdam")
    for s in range(steps):
        F.train_step(model, opt, scaler, "bf16model-FusedAdam", s, plan.get(s))
    counts = {float(opt.state[p]["step"]) for p in model.parameters()}
    assert counts == {float(steps - len(plan))}


def test_the_check_can_fail():
    """Control: a poisoned run without the scaler's skip (static scale, step always taken)
    does go non-finite, so the finiteness check above is not vacuous."""
    from peak import amp

    model, opt, _ = F.build("bf16model-FusedAdam")
    scaler = amp.GradScaler("cpu", enabled=False)
    F.train_step(model, opt, scaler, "bf16model-FusedAdam", 0, ("grad_nan", 0, 0.5))
    assert not F.all_finite(F.state_tensors(model, opt))


HERE = Path(__file__).parent


def _child(config, steps, ckpt, out, *slow_after):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(HERE / "fault_helpers.py"), config, str(steps), str(ckpt), str(out),
                             *map(str, slow_after)], stdout=subprocess.PIPE, text=True, env=env)


@pytest.mark.parametrize("config", ["f16model-FusedAdam", "f32-autocast-f16-Adam"])
def test_sigkill_then_resume_is_bit_for_bit(config, tmp_path):
    steps, kill_after = 150, 60
    F.main(config, steps, str(tmp_path / "a.ckpt"), str(tmp_path / "a.out"))  # uninterrupted
    # killed with SIGKILL once it has passed step `kill_after` (its saves slowed from there: the
    # kill lands mid-save even when this process loses the CPU for a while), then resumed
    p = _child(config, steps, tmp_path / "b.ckpt", tmp_path / "b.out", kill_after)
    for line in p.stdout:
        if line.startswith("step ") and int(line.split()[1]) >= kill_after:
            break
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL and not (tmp_path / "b.out").exists()
    ck = torch.load(tmp_path / "b.ckpt", weights_only=False)
    assert kill_after <= ck["step"] < steps
    p = _child(config, steps, tmp_path / "b.ckpt", tmp_path / "b.out")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0 and out.startswith(f"resumed {ck['step']}")
    a, b = torch.load(tmp_path / "a.out", weights_only=False), torch.load(tmp_path / "b.out", weights_only=False)
    assert a["scale"] == b["scale"]
    for i, (x, y) in enumerate(zip(a["state"], b["state"], strict=True)):
        assert x.dtype == y.dtype and torch.equal(x, y), f"state tensor {i} differs after resume"
