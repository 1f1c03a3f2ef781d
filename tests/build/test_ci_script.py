"""CI's script (.ci/run, NOTE: [CI lanes]) with `make` replaced by a stub: both lanes run, either
lane's failure fails the run with its exit status, and a failure in the foreground lane stops the
background one (no compiler left running after CI gave up)."""
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A `make` that records each target, sleeps a little, and fails the target named in FAIL_TARGET.
# With SLOW_SANITIZE, the sanitizer target sleeps long (its pid in a file) and `test` fails only
# once that sleep has begun, so that the run can be seen to stop it.
FAKE_MAKE = """#!/bin/bash
echo "fake make $1" >> "$CI_TRACE"
if [ "$1" = test-sanitize ] && [ -n "$SLOW_SANITIZE" ]; then
  sleep 30 & echo $! > "$CI_TRACE.sleeper"; wait
fi
sleep 0.2
if [ "$1" = test ] && [ -n "$SLOW_SANITIZE" ]; then  # fail once the other lane is in its sleep
  for _ in $(seq 100); do [ -s "$CI_TRACE.sleeper" ] && break; sleep 0.1; done
fi
if [ "$1" = "$FAIL_TARGET" ]; then exit 7; fi
echo "fake $1 done"
"""


def _run_ci(tmp_path, **env):
    root = tmp_path / "repo"
    (root / ".ci").mkdir(parents=True)
    shutil.copy(REPO / ".ci" / "run", root / ".ci" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "make").write_text(FAKE_MAKE)
    (bin_dir / "make").chmod(0o755)
    trace = tmp_path / "trace"
    full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CI_TRACE": str(trace),
                "FAIL_TARGET": "", **env}
    r = subprocess.run([str(root / ".ci" / "run")], capture_output=True, text=True, env=full_env,
                       timeout=120)
    targets = trace.read_text().split("\n") if trace.exists() else []
    return r, [t.removeprefix("fake make ") for t in targets if t], root, trace


def test_both_lanes_run_every_step(tmp_path):
    r, targets, root, _ = _run_ci(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(targets) == sorted(["test", "soak", "docs", "test-cuda-build", "test-sanitize"])
    # The background lane's log is printed at the end, with its own step times.
    assert "fake test-sanitize done" in r.stdout
    assert "=== ci: make test-cuda-build PYTEST_ARGS=-q took" in r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith("=== ci: total ")
    assert (root / "build" / "ci-variants.log").exists()


@pytest.mark.parametrize("failing", ["test-cuda-build", "test-sanitize"])
def test_a_background_failure_fails_the_run(tmp_path, failing):
    r, targets, _, _ = _run_ci(tmp_path, FAIL_TARGET=failing)
    assert r.returncode == 7, r.stdout + r.stderr
    assert "the CUDA and sanitizer lane failed (exit 7)" in r.stdout
    assert "=== ci: total" not in r.stdout
    # The foreground lane still ran to its end.
    assert {"test", "soak", "docs"} <= set(targets)


def test_a_foreground_failure_stops_the_background_lane(tmp_path):
    start = time.monotonic()
    r, targets, _, trace = _run_ci(tmp_path, FAIL_TARGET="test", SLOW_SANITIZE="1")
    assert r.returncode == 7, r.stdout + r.stderr
    assert "soak" not in targets and "docs" not in targets
    assert time.monotonic() - start < 25, "the run waited for the background lane"
    pid = int(Path(f"{trace}.sleeper").read_text())
    for _ in range(50):
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid), "the background lane's process outlived the run"


def _alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
