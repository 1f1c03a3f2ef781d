"""examples/imagenet/main_amp.py runs, its loss decreases, and its checkpoint resume is bit-for-bit."""
import os
import re
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "imagenet", "main_amp.py")


def _run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")  # tiny tensors; same thread count in every run
    proc = subprocess.run([sys.executable, EXAMPLE, "--batch-size", "16", "--image-size", "16", "--print-freq", "1",
                           "--device", "cpu", *args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _losses(out):
    return {int(s): l for s, l in re.findall(r"step (\d+)  loss (\S+)", out)}


@pytest.mark.parametrize("opt_level, dtype", [("O1", "fp16"), ("O2", "bf16"), ("O3", "bf16")])
def test_example_trains(opt_level, dtype):
    out = _run("--opt-level", opt_level, "--dtype", dtype, "--steps", "20")
    losses = [float(v) for _, v in sorted(_losses(out).items())]
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    assert "throughput" in out and f"Selected optimization level {opt_level}" in out


def test_example_resume_is_bit_for_bit(tmp_path):
    common = ["--opt-level", "O2", "--dtype", "fp16", "--steps", "3", "--loss-scale", "dynamic"]
    full = _losses(_run(*common, "--epochs", "2"))
    ckpt = str(tmp_path / "ckpt.pt")
    first = _losses(_run(*common, "--epochs", "1", "--save", ckpt))
    second_out = _run(*common, "--epochs", "2", "--resume", ckpt)
    assert "=> resumed from" in second_out
    second = _losses(second_out)
    assert sorted(first) == [0, 1, 2] and sorted(second) == [3, 4, 5]
    assert {**first, **second} == full
