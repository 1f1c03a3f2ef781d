"""`make gpu-check` (tools/gpu_check.py) without a GPU: its report's sections with the steps
stubbed, its failure parsing (junit XML, and a pytest log cut short), its timeouts (the step's
process group stopped, the budget handed down, later steps marked not run), the CUDA test
selection, and the GPU benchmark's code at toy sizes on the CPU."""
import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gc = _load("gpu_check", REPO / "tools" / "gpu_check.py")

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="4">
<testcase classname="tests.ops.test_multi_tensor_ops" name="test_cuda_equals_cpu[f16]" time="0.1"/>
<testcase classname="tests.optimizers.test_fused_optimizers" name="test_cuda_equals_cpu[bf16]" time="0.2">
  <failure message="AssertionError: Tensor-likes are not equal!&#10;Mismatched elements: 3 / 4099">trace</failure>
</testcase>
<testcase classname="tests.caster.test_caster_worker_threads" name="test_cuda_checkpoint[O1-True]" time="0">
  <error message="failed on setup with &quot;RuntimeError: CUDA error: illegal memory access&quot;">trace</error>
</testcase>
<testcase classname="tests.ops.test_multi_tensor_ops" name="test_x[cuda]" time="0">
  <skipped type="pytest.skip" message="no CUDA device">skip</skipped>
</testcase>
</testsuite></testsuites>
"""


def test_parse_junit_counts_and_messages(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    counts, failures = gc.parse_junit(path)
    assert counts == {"passed": 1, "failed": 1, "error": 1, "skipped": 1}
    assert failures == [
        ("tests.optimizers.test_fused_optimizers::test_cuda_equals_cpu[bf16]", "failed",
         "AssertionError: Tensor-likes are not equal! / Mismatched elements: 3 / 4099"),
        ("tests.caster.test_caster_worker_threads::test_cuda_checkpoint[O1-True]", "error",
         'failed on setup with "RuntimeError: CUDA error: illegal memory access"')]
    assert gc.parse_junit(tmp_path / "missing.xml") is None
    (tmp_path / "cut.xml").write_text(JUNIT[:200])  # a file pytest did not finish writing
    assert gc.parse_junit(tmp_path / "cut.xml") is None


LOG_CUT_SHORT = """\
============================= test session starts ==============================
tests/ops/test_multi_tensor_ops.py::test_cuda_equals_cpu[f16] PASSED     [ 25%]
tests/ops/test_multi_tensor_ops.py::test_cuda_equals_cpu[bf16] FAILED    [ 50%]
tests/ops/test_multi_tensor_ops.py::test_other[cuda] SKIPPED (no CUDA)   [ 60%]
tests/optimizers/test_fused_optimizers.py::test_cuda_equals_cpu[f32] 
[gpu_check: stopped after 120 s]
"""


def test_parse_pytest_log_of_a_run_stopped_midway():
    counts, failures, running = gc.parse_pytest_log(LOG_CUT_SHORT)
    assert counts == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert failures == [("tests/ops/test_multi_tensor_ops.py::test_cuda_equals_cpu[bf16]",
                         "failed", "")]
    assert running == "tests/optimizers/test_fused_optimizers.py::test_cuda_equals_cpu[f32]"
    # A finished run: the short summary's messages replace the bare outcome.
    done = LOG_CUT_SHORT.replace("tests/optimizers/test_fused_optimizers.py::test_cuda_equals_cpu[f32] \n", "")
    done += "FAILED tests/ops/test_multi_tensor_ops.py::test_cuda_equals_cpu[bf16] - assert 1 == 2\n"
    counts, failures, running = gc.parse_pytest_log(done)
    assert running is None
    assert failures == [("tests/ops/test_multi_tensor_ops.py::test_cuda_equals_cpu[bf16]",
                         "failed", "assert 1 == 2")]


def test_run_logged_stops_the_whole_process_group_at_its_timeout(tmp_path):
    log = tmp_path / "step.log"
    pidfile = tmp_path / "child.pid"
    # The step starts a child of its own (as pytest or ninja do): both must be stopped.
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pidfile)!r}, "w").write(str(child.pid))
        print("started", flush=True)
        time.sleep(60)
    """)
    t0 = time.monotonic()
    res = gc.run_logged([sys.executable, "-c", script], log, timeout=6)
    assert res.timed_out and not res.ok
    assert time.monotonic() - t0 < 30
    assert res.status().startswith("TIMEOUT after")
    text = log.read_text()
    assert "started" in text and "[gpu_check: stopped after 6 s]" in text
    child = int(pidfile.read_text())
    if not _ends(child):  # (reaped by init shortly after the kill)
        pytest.fail(f"the step's child {child} outlived the timeout")
    ok = gc.run_logged([sys.executable, "-c", "print('fine')"], log, timeout=30)
    assert ok.ok and ok.status() == "ok" and "fine" in log.read_text()
    assert gc.run_logged([sys.executable, "-c", "raise SystemExit(3)"], log, 30).status() == \
        "FAILED (exit 3)"
    assert gc.run_logged(["true"], log, timeout=0).timed_out  # no time left: never started


def test_cap_file_keeps_head_and_tail(tmp_path):
    path = tmp_path / "big.log"
    path.write_bytes(b"HEAD" + b"x" * 5000 + b"TAIL")
    gc.cap_file(path, limit=1000)
    data = path.read_bytes()
    assert len(data) <= 1000 and data.startswith(b"HEAD") and data.endswith(b"TAIL")


def _stub_steps(monkeypatch, tmp_path, tests_result, sleep_in_tests=0.0):
    """Replaces the steps' commands: build, smoke and bench write what they would, the CUDA test
    step gets a pytest log and junit XML written by a fake pytest."""
    pkg = tmp_path / "pkg"
    (pkg / "peak").mkdir(parents=True)

    def build(args, facts, report, log, timeout):
        report.add("## Build\n\nok in 1.0 s (stub)\n")
        return gc.Result(0, 1.0, False), pkg

    def smoke(args, env, report, log, timeout):
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(pkg)
        report.add("## Smoke test (cpu)\n\nok (stub)\n")
        return gc.Result(0, 0.5, False)

    def fake_run_logged(cmd, log, timeout, env=None, cwd=gc.REPO):
        assert "gpu_check_select" in cmd and "tests" in cmd
        assert str(gc.REPO / "tools") in env["PYTHONPATH"].split(os.pathsep)
        time.sleep(sleep_in_tests)
        log.write_text(tests_result["log"])
        junit = [c for c in cmd if c.startswith("--junitxml=")][0].split("=", 1)[1]
        if tests_result.get("junit"):
            Path(junit).write_text(tests_result["junit"])
        return gc.Result(tests_result["rc"], sleep_in_tests, tests_result.get("timed_out", False))

    def bench(args, env, report, out, timeout):
        report.add(f"## Benchmarks (benchmarks/bench_gpu.py)\n\nok; given {timeout:.0f} s\n")
        return gc.Result(0, 0.1, False)

    monkeypatch.setattr(gc, "build", build)
    monkeypatch.setattr(gc, "smoke", smoke)
    monkeypatch.setattr(gc, "run_logged", fake_run_logged)
    monkeypatch.setattr(gc, "bench", bench)


def test_report_sections_and_failures(monkeypatch, tmp_path):
    _stub_steps(monkeypatch, tmp_path, {"rc": 1, "junit": JUNIT, "log": "(pytest output)\n"})
    out = tmp_path / "out"
    rc = gc.main(["--out", str(out), "--dry-run"])
    assert rc == 1  # a failing test fails the check
    report = (out / "report.md").read_text()
    sections = [line for line in report.splitlines() if line.startswith("## ")]
    assert sections == ["## Machine", "## Build", "## Smoke test (cpu)", "## CUDA tests",
                        "## Benchmarks (benchmarks/bench_gpu.py)", "## Summary"]
    assert "# peak gpu-check (DRY RUN)" in report and "- torch: " in report
    assert "1 passed, 1 failed, 1 errors, 1 skipped" in report
    assert ("| `tests.optimizers.test_fused_optimizers::test_cuda_equals_cpu[bf16]` | failed | "
            "AssertionError: Tensor-likes are not equal! / Mismatched elements: 3 / 4099 |") in report
    assert "CUDA error: illegal memory access" in report
    assert "| tests | FAILED (exit 1) |" in report and "**Failed: tests.**" in report
    assert len(list(out.iterdir())) <= 8


def test_report_of_a_test_step_stopped_at_its_timeout(monkeypatch, tmp_path):
    _stub_steps(monkeypatch, tmp_path, {"rc": -15, "timed_out": True, "log": LOG_CUT_SHORT},
                sleep_in_tests=3)
    monkeypatch.setattr(gc, "describe_machine", lambda args, report: report.add("## Machine\n"))
    out = tmp_path / "out"
    # The tests leave less than the 5 s a step needs of a 7-second budget: the benchmark is not
    # started.
    rc = gc.main(["--out", str(out), "--dry-run", "--budget-s", "7"])
    assert rc == 1
    report = (out / "report.md").read_text()
    assert "from pytest.log (no junit.xml: pytest did not finish)" in report
    assert "**The run was stopped at its time limit**; the test running then: " \
           "`tests/optimizers/test_fused_optimizers.py::test_cuda_equals_cpu[f32]`" in report
    assert "| `tests/ops/test_multi_tensor_ops.py::test_cuda_equals_cpu[bf16]` | failed |" in report
    assert "| bench | not run (budget spent) |" in report


def test_an_empty_cuda_selection_fails_the_check(monkeypatch, tmp_path):
    _stub_steps(monkeypatch, tmp_path, {"rc": 5, "log": "no tests ran\n"})
    out = tmp_path / "out"
    assert gc.main(["--out", str(out), "--dry-run"]) == 1
    assert "FAILED (exit 5: no CUDA test was selected)" in (out / "report.md").read_text()


def test_torch_range_is_read_without_importing_peak():
    rng = gc.supported_torch()
    assert rng is not None and rng[0] <= rng[1]
    assert gc.torch_in_range("2.11.0+cu130", ((2, 10), (2, 15)))
    assert not gc.torch_in_range("2.11.0+cu130", ((2, 13), (2, 14)))


SELECTION = '''
import pytest, torch
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

@pytest.mark.cuda
def test_marked(): pass

@pytest.mark.parametrize("device", DEVICES)
def test_param(device): pass

@pytest.mark.skipif(True, reason="needs a CUDA GPU")
def test_skipif(): pass

@pytest.mark.parametrize("dev", [torch.device("cuda:0"), "cpu"])
def test_device_object(dev): pass

def test_emulated_cuda_grid_on_the_cpu(): pass
'''


def test_selection_keeps_the_cuda_tests_only(tmp_path):
    (tmp_path / "test_sel.py").write_text(SELECTION)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda: needs a CUDA device\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO / "tools")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "gpu_check_select", "-p",
                          "no:cacheprovider", "--collect-only", "-q", "test_sel.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    selected = sorted(line for line in out.stdout.splitlines() if "::" in line)
    assert selected == ["test_sel.py::test_device_object[dev0]", "test_sel.py::test_marked",
                        "test_sel.py::test_param[cuda]", "test_sel.py::test_skipif"], out.stdout
    assert "deselected" in out.stdout


def test_gpu_benchmark_code_runs_at_toy_sizes_on_the_cpu(tmp_path):
    md = tmp_path / "bench.md"
    sections = "unscale,optimizer"
    if importlib.util.find_spec("transformers") is not None:
        sections += ",training"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_gpu.py"), "--device", "cpu", "--tiny",
         "--repeats", "1", "--compile", "off", "--sections", sections, "--out", str(md)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = md.read_text()
    assert "FAILED" not in text
    assert "### Unscale + inf/NaN check, fp16 gradients, in place" in text
    assert "| 8x64K | peak multi_tensor_scale_ |" in text
    assert "### One optimizer step, GPT-2-medium shapes" in text
    for row in ("amp O2 step, FusedAdam", "lean: remainder + bf16 moments",
                "lean: remainder + 8-bit moments", "torch AdamW(fused=True), fp32 weights"):
        assert f"| {row}" in text
    assert "vs torch >= 1.45:" in text and "of copy >= 0.8:" in text
    if "training" in sections:
        assert "| O2 vs torch | amp O2 + FusedAdam |" in text
        assert "| O1 vs torch | amp O1 + AdamW(fused=True) |" in text
        assert "| compiled (no target) | torch.compile | skipped |" in text



def test_step_profile_runs_at_toy_sizes_on_the_cpu(tmp_path):
    """benchmarks/profile_gpu_step.py (host and kernel time of one optimizer step) runs where
    there is no GPU: every contender gets its row and the host's Python its cProfile table."""
    md = tmp_path / "profile.md"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "profile_gpu_step.py"), "--device", "cpu",
         "--tiny", "--rounds", "1", "--out", str(md)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = md.read_text()
    for row in ("amp O2 step, FusedAdam", "lean: remainder + bf16 moments",
                "lean: remainder + 8-bit moments", "torch AdamW(fused=True)"):
        assert f"| {row} | " in text
    assert text.count("host Python (cProfile, 10 steps)") == 3 and "_fused_step" in text

def _collection_error_run(module, reason):
    junit = JUNIT.replace('<testcase classname="tests.ops.test_multi_tensor_ops" name="test_x[cuda]"',
                          f'<testcase classname="" name="{module}" time="0"><error message='
                          f'"collection failure">trace</error></testcase>\n'
                          '<testcase classname="tests.ops.test_multi_tensor_ops" name="test_x[cuda]"')
    # Only the passing and the skipped test besides the collection error.
    junit = junit.split("<testcase classname=\"tests.optimizers")[0] + \
        "<testcase classname=\"\"" + junit.split("<testcase classname=\"\"", 1)[1]
    path = module.replace(".", "/") + ".py"
    log = (f"_____ ERROR collecting {path} _____\nImportError while importing test module\n"
           f"Traceback:\nE   {reason}\n==== short test summary info ====\nERROR {path}\n")
    return {"rc": 1, "junit": junit, "log": log}


@pytest.mark.parametrize("reason, fails", [
    ("ImportError: No module named 'myst_parser': the docs build needs sphinx", False),
    ("ImportError: No module named 'peak._C'", True),
    ("SyntaxError: invalid syntax", True)])
def test_collection_errors_fail_the_check_unless_a_package_is_missing(monkeypatch, tmp_path,
                                                                      reason, fails):
    _stub_steps(monkeypatch, tmp_path, _collection_error_run("tests.docs.test_docs_build", reason))
    out = tmp_path / "out"
    rc = gc.main(["--out", str(out), "--dry-run"])
    report = (out / "report.md").read_text()
    assert "1 passed, 0 failed, 0 errors, 1 skipped" in report
    assert f"| `tests/docs/test_docs_build.py` | {reason} | " in report
    assert ("| tests | ok |" in report) is not fails
    assert rc == (1 if fails else 0)


def test_stopped_from_outside_it_says_so_and_stops_its_step(tmp_path):
    """An outer time limit (make killed by the machine's own timeout) sends TERM: the report
    says what was finished, and the step's processes do not outlive gpu_check."""
    out = tmp_path / "out"
    marker = tmp_path / "step.pid"
    driver = textwrap.dedent(f"""
        import sys, importlib.util
        spec = importlib.util.spec_from_file_location("gpu_check", {str(REPO / "tools" / "gpu_check.py")!r})
        gc = importlib.util.module_from_spec(spec); spec.loader.exec_module(gc)
        gc.describe_machine = lambda args, report: report.add("## Machine\\n")
        def build(args, facts, report, log, timeout):
            res = gc.run_logged([sys.executable, "-c",
                                 "import os, time; open({str(marker)!r}, 'w').write(str(os.getpid())); "
                                 "time.sleep(60)"], log, timeout)
            return res, None
        gc.build = build
        sys.exit(gc.main(["--out", {str(out)!r}, "--dry-run"]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver])
    for _ in range(300):
        if marker.exists() and marker.read_text():
            break
        time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("the stubbed build step never started")
    proc.terminate()
    assert proc.wait(timeout=30) == 128 + 15
    report = (out / "report.md").read_text()
    assert "## Machine" in report and "stopped by signal 15" in report
    step = int(marker.read_text())
    if not _ends(step):
        pytest.fail(f"the step's process {step} outlived gpu_check")


def _ends(pid: int, seconds: float = 10.0) -> bool:
    """``pid`` is gone or a zombie within ``seconds`` (it may be reaped while /proc is read)."""
    for _ in range(int(seconds * 10)):
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except OSError:  # (FileNotFoundError, or ProcessLookupError once reaped mid-read)
            return True
        time.sleep(0.1)
    return False


def test_a_crashing_test_is_reported_and_the_run_resumes_after_it(monkeypatch, tmp_path):
    """A segfault in one test ends pytest: gpu_check reruns without the tests already done and
    without the crashed one, and reports the crash as that test's failure."""
    _stub_steps(monkeypatch, tmp_path, {"rc": 0, "log": ""})
    calls = []
    crash_log = ("tests/a.py::test_one[cuda] PASSED [ 10%]\n"
                 "tests/a.py::test_two[cuda] FAILED [ 20%]\n"
                 "tests/a.py::test_crash Fatal Python error: Segmentation fault\n\n"
                 "Current thread 0x1 (most recent call first):\n  File \"x.py\", line 1\n")
    rest_log = "tests/b.py::test_three[cuda] PASSED [ 50%]\n"
    junit = ('<testsuites><testsuite name="pytest" errors="0" failures="0" skipped="0" '
             'tests="1"><testcase classname="tests.b" name="test_three[cuda]" time="0.1"/>'
             '</testsuite></testsuites>')

    def fake_run_logged(cmd, log, timeout, env=None, cwd=gc.REPO):
        calls.append(cmd)
        with open(log, "a") as f:
            f.write(crash_log if len(calls) == 1 else rest_log)
        if len(calls) == 1:
            return gc.Result(-11, 1.0, False)
        Path([c for c in cmd if c.startswith("--junitxml=")][0].split("=", 1)[1]).write_text(junit)
        return gc.Result(0, 1.0, False)

    monkeypatch.setattr(gc, "run_logged", fake_run_logged)
    out = tmp_path / "out"
    assert gc.main(["--out", str(out), "--dry-run"]) == 1
    assert len(calls) == 2 and calls[1][-1] == "tests"
    assert {"--deselect=tests/a.py::test_crash", "--deselect=tests/a.py::test_one[cuda]",
            "--deselect=tests/a.py::test_two[cuda]"} <= set(calls[1])
    report = (out / "report.md").read_text()
    assert "FAILED (a test crashed the interpreter)" in report
    assert "2 passed, 2 failed, 0 errors, 0 skipped" in report
    assert "| `tests/a.py::test_crash` | failed | crashed the interpreter: Segmentation fault" \
        in report


def test_the_commit_line_names_files_changed_since_the_commit(tmp_path):
    """A report names the commit and, when the tree differs from it (a copied tree with another
    commit's .git), the files that differ."""
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                       check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "one")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path,
                          capture_output=True, text=True).stdout.strip()
    assert gc.commit_line(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "untracked.py").write_text("")
    assert gc.commit_line(tmp_path) == f"{head} with 1 tracked files changed (a.py)"
    assert gc.commit_line(tmp_path / "nonexistent") == "(no git here)"
