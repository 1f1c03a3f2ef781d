"""Every example under examples/ runs for a few steps with short flags, and its loss decreases.

(examples/imagenet/main_amp.py is covered by tests/amp/test_amp_example.py, including checkpoint resume.)
Each example runs in a subprocess, as a user would run it, on the CPU with one intra-op thread."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run(script, *args, timeout=300, cwd=None):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def values(out, key):
    return [float(v) for v in re.findall(rf"\b{key} (\S+)", out)]


# ------------------------------------------------------------------------------------------- DCGAN
@pytest.mark.parametrize("opt_level, dtype", [("O1", "bf16"), ("O2", "bf16"), ("O2", "fp16")])
def test_dcgan_trains(opt_level, dtype):
    steps = "40" if dtype == "bf16" else "12"  # fp16 convolutions are slow on the CPU
    out = run("dcgan/main_amp.py", "--opt-level", opt_level, "--dtype", dtype, "--steps", steps,
              "--batch-size", "32", "--ngf", "16", "--ndf", "16", "--print-freq", "1", "--device", "cpu",
              "--no-progress")
    loss_d, gap = values(out, "loss_D"), values(out, "moment_gap")
    assert len(loss_d) == int(steps)
    # D learns to tell real from fake (1.386 = 2 ln 2 at the start) and G's samples move towards the data
    assert sum(loss_d[-3:]) / 3 < 0.9 * sum(loss_d[:3]) / 3, loss_d
    assert gap[-1] < gap[0], gap
    scales = re.findall(r"loss_scales (\S+) (\S+) (\S+)", out)
    assert len(scales[-1]) == 3  # three losses, three scalers
    assert "throughput" in out and "img/s" in out


def test_dcgan_separate_scalers_for_fp16():
    # fp16 + dynamic scaling: the three scalers move independently (they start at 65536 and back off
    # on their own overflows)
    out = run("dcgan/main_amp.py", "--opt-level", "O1", "--dtype", "fp16", "--steps", "4", "--batch-size", "16",
              "--ngf", "8", "--ndf", "8", "--print-freq", "1", "--device", "cpu", "--no-progress")
    final = re.findall(r"amp state (\{.*\})", out)[0]
    assert final.count("loss_scaler") == 3


# ------------------------------------------------------------------------------------- transformer
SMALL_LM = ["--batch-size", "8", "--context", "32", "--d-model", "64", "--print-freq", "1",
            "--sample-chars", "10", "--device", "cpu", "--no-progress"]


@pytest.mark.parametrize("opt_level, dtype, extra", [
    ("O1", "bf16", []),
    ("O2", "bf16", ["--accum-steps", "3"]),
    ("O2", "fp16", ["--accum-steps", "2", "--delay-unscale"]),
])
def test_transformer_lm_trains(opt_level, dtype, extra):
    out = run("transformer_lm/train.py", "--opt-level", opt_level, "--dtype", dtype, "--steps", "12",
              *SMALL_LM, *extra)
    losses = [float(v) for v in re.findall(r"^step \d+  loss (\S+)", out, flags=re.M)]
    norms = values(out, "grad_norm")
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < 0.92 * sum(losses[:3]) / 3, losses
    assert all(n > 0 for n in norms)  # clipping saw unscaled, finite gradients
    val = float(re.search(r"validation loss (\S+) \(uniform guess: (\S+)\)", out).group(1))
    uniform = float(re.search(r"uniform guess: (\S+)\)", out).group(1))
    assert val < uniform
    assert "tok/s" in out and "sample:" in out


def test_transformer_lm_clipping_bounds_the_master_gradients():
    # --clip-grad tiny: the reported norm is the norm *before* clipping (clip_grad_norm_'s return value);
    # training still works because the step uses the clipped master gradients
    out = run("transformer_lm/train.py", "--opt-level", "O2", "--dtype", "bf16", "--steps", "4",
              "--clip-grad", "0.01", *SMALL_LM)
    assert all(n > 0.01 for n in values(out, "grad_norm"))


# ------------------------------------------------------------------------------- torch.amp migration
@pytest.mark.parametrize("dtype, init_scale", [("fp16", "16777216"), ("bf16", "65536")])
def test_torch_amp_migration_same_numbers(dtype, init_scale):
    # init_scale 2**24 makes the first fp16 steps overflow: both dialects must back off and skip alike
    common = ["--dtype", dtype, "--steps", "30", "--print-freq", "1", "--init-scale", init_scale, "--device", "cpu"]
    outs = {d: run("torch_amp_migration.py", "--dialect", d, *common) for d in ("peak", "torch")}
    steps = {d: re.findall(r"^step .*$", out, flags=re.M) for d, out in outs.items()}
    assert len(steps["peak"]) == 30
    assert steps["peak"] == steps["torch"]  # the same losses and scales, printed to 6 digits
    losses = values(outs["peak"], "loss")
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    scales = values(outs["peak"], "scale")
    if dtype == "fp16":
        assert scales[0] < 2.0**24 and len(set(scales)) > 1  # backed off
    assert "peak.amp" in outs["peak"] and "torch.amp" in outs["torch"]


# -------------------------------------------------------------------------------------------- demo
def test_demo_table_and_plot(tmp_path):
    png = tmp_path / "demo.png"
    out = run("demo.py", "--steps", "10", "--fp16-steps", "3", "--batch-size", "8", "--device", "cpu",
              "--out", str(png))
    rows = re.findall(r"^(O[0-3])\s+(fp32|fp16|bf16)\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\d+)$",
                      out, flags=re.M)
    assert [(r[0], r[1]) for r in rows] == [("O0", "fp32"), ("O1", "fp16"), ("O1", "bf16"), ("O2", "fp16"),
                                            ("O2", "bf16"), ("O3", "fp16"), ("O3", "bf16")]
    for level, dtype, steps, first, final, ms, mem, scale, skipped in rows:
        assert int(steps) == (3 if dtype == "fp16" else 10)
        assert float(mem) > 0 and float(ms) > 0
        if dtype != "fp16":
            assert float(final) < float(first), (level, dtype, first, final)
    mem = {(r[0], r[1]): float(r[6]) for r in rows}
    assert mem[("O1", "bf16")] < mem[("O0", "fp32")]  # half-size activations
    assert f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
