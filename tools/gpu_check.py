#!/usr/bin/env python3
"""`make gpu-check`: check peak on this machine's GPU with one command, into one report.

    python3 tools/gpu_check.py [--out DIR] [--dry-run] [--budget-s S] [--jobs N]
                               [--build-timeout S] [--smoke-timeout S] [--test-timeout S]
                               [--bench-timeout S] [--skip build,smoke,tests,bench]

Runs with the interpreter that runs it (its torch, no venv, no network) and, in order of
importance, each step under its own timeout and all of them under --budget-s:
1. build: peak's extension with CMake + Ninja into build/gpu-check (incremental on a rerun) for
   the local GPU's architecture only (PEAK_CUDA_ARCHS, default: read from the device, e.g.
   90-real), the native CPU level only (PEAK_CPU_ISA=native), with the test-only twins; then a
   package tree build/gpu-check/pkg/peak (links to python/peak plus the built module) that the
   later steps import through PYTHONPATH. Nothing is installed into the interpreter.
2. smoke: import peak, ``python -m peak.info``, the unscale + inf/NaN check, one FusedAdam step
   on the GPU compared bit for bit with the same step on the CPU (and with torch's AdamW).
3. tests: every CUDA test (tools/gpu_check_select.py: the ``cuda`` marker, CUDA skipifs, CUDA
   device parameters), with pytest-timeout's per-test limit when it is installed.
4. bench: benchmarks/bench_gpu.py (unscale, optimizer steps, a GPT-2 training step).

The report (DIR/report.md) is written as the run goes, flushed after each step, so a run cut
short still leaves what it did; beside it: build.log, smoke.log, pytest.log, junit.xml,
bench.md, bench.log (a flat folder of at most 8 files, each capped below 16 MB).

--dry-run (no GPU needed): builds CPU-only into build/gpu-check-cpu, runs the smoke test on the
CPU, the CUDA test selection (which skips without a device) and the benchmarks at toy sizes on
the CPU, and writes the same report.
"""
import argparse
import datetime
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = ("build", "smoke", "tests", "bench")
MAX_FILE_BYTES = 15 * 2**20  # the device tool returns files under 16 MB
MAX_CRASHES = 3  # test runs resumed after a crashed interpreter


# ---- the report

class Report:
    """A markdown file appended to and flushed to disk after every write."""

    def __init__(self, path: Path):
        self.path = path
        path.write_text("")

    def add(self, text: str = "") -> None:
        if text.startswith("## "):
            text = "\n" + text  # ends the table or list before it
        with open(self.path, "a") as f:
            f.write(text if text.endswith("\n") else text + "\n")
            f.flush()
            os.fsync(f.fileno())
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()


def fence(text: str, limit: int = 4000) -> str:
    text = text.rstrip("\n")
    if len(text) > limit:
        text = "[...]\n" + text[-limit:]
    return f"```\n{text}\n```\n"


def cap_file(path: Path, limit: int = MAX_FILE_BYTES) -> None:
    """Keeps a log under the size the device tool returns: its head and its tail."""
    if path.exists() and path.stat().st_size > limit:
        data = path.read_bytes()
        keep = limit // 8
        path.write_bytes(data[:keep] + b"\n[... cut by gpu_check to stay under 16 MB ...]\n"
                         + data[-(limit - keep - 100):])


# ---- running steps

class Result:
    def __init__(self, rc, seconds, timed_out):
        self.rc, self.seconds, self.timed_out = rc, seconds, timed_out

    @property
    def ok(self):
        return self.rc == 0 and not self.timed_out

    def status(self):
        if self.timed_out:
            return f"TIMEOUT after {self.seconds:.0f} s"
        return "ok" if self.rc == 0 else f"FAILED (exit {self.rc})"


_RUNNING = []  # the step's process while one runs (stopped with gpu_check itself)


def on_signal(report: "Report"):
    """A handler for TERM/INT/HUP (an outer timeout stopping `make gpu-check`): stops the
    running step's process group and says so in the report before exiting."""
    def handler(signum, frame):
        for proc in list(_RUNNING):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        report.add(f"\n**gpu_check was stopped by signal {signum} (an outer time limit?)**: the "
                   "sections above are what it finished.\n")
        os._exit(128 + signum)
    return handler


def run_logged(cmd, log: Path, timeout: float, env=None, cwd=REPO) -> Result:
    """Runs ``cmd`` with its output appended to ``log``; past ``timeout`` its process group
    (the command and whatever it started) is stopped: TERM, then KILL."""
    t0 = time.monotonic()
    with open(log, "ab") as out:
        shown = [str(c) if "\n" not in str(c) else "'<script: tools/gpu_check.py>'" for c in cmd]
        out.write(f"\n$ {' '.join(shown)}\n".encode())
        out.flush()
        if timeout <= 0:
            out.write(b"[not started: no time left]\n")
            return Result(None, 0.0, True)
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=cwd, env=env,
                                start_new_session=True)
        _RUNNING.append(proc)
        try:
            rc = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = proc.returncode
            out.write(f"\n[gpu_check: stopped after {timeout:.0f} s]\n".encode())
        finally:
            _RUNNING.remove(proc)
    cap_file(log)
    return Result(rc, time.monotonic() - t0, timed_out)


def capture(cmd, timeout=30, env=None, cwd=REPO) -> str:
    """A short command's output, or why there is none."""
    try:
        p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                           timeout=timeout, env=env, cwd=cwd)
        return (p.stdout + p.stderr).strip() or f"(no output, exit {p.returncode})"
    except FileNotFoundError:
        return f"({cmd[0]} not found)"
    except subprocess.TimeoutExpired:
        return f"({cmd[0]} timed out)"


def commit_line(repo=REPO) -> str:
    """The commit the tree is, and the tracked files that differ from it: a copied tree may come
    with another commit's .git (a lent machine's copy), and the report must not name a commit
    the code is not."""
    commit = capture(["git", "rev-parse", "--short", "HEAD"], cwd=repo)
    if not re.fullmatch(r"[0-9a-f]+", commit):
        return "(no git here)"
    changed = capture(["git", "diff", "--name-only", "HEAD"], cwd=repo)
    changed = [] if changed.startswith("(") else changed.splitlines()  # ((no output, exit 0))
    if not changed:
        return commit
    more = ", ..." if len(changed) > 6 else ""
    return f"{commit} with {len(changed)} tracked files changed ({', '.join(changed[:6])}{more})"


def tool(name: str) -> str | None:
    """A build tool: next to the interpreter first (a venv's cmake/ninja), then on PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def find_nvcc() -> str | None:
    for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).exists():
            return cand
    return None


# ---- step 0: the machine

PROBE = r"""
import json, torch
d = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
     "cuda_available": torch.cuda.is_available()}
if d["cuda_available"]:
    p = torch.cuda.get_device_properties(0)
    d.update(device=p.name, capability="%d%d" % (p.major, p.minor),
             memory_gib=round(p.total_memory / 2**30, 1), devices=torch.cuda.device_count())
print(json.dumps(d))
"""


def supported_torch():
    """peak's accepted torch range, read from python/peak/_extension.py without importing it."""
    text = (REPO / "python/peak/_extension.py").read_text()
    m = re.search(r"SUPPORTED_TORCH\s*=\s*\(\((\d+),\s*(\d+)\),\s*\((\d+),\s*(\d+)\)\)", text)
    return ((int(m[1]), int(m[2])), (int(m[3]), int(m[4]))) if m else None


def torch_in_range(version: str, rng) -> bool | None:
    m = re.match(r"(\d+)\.(\d+)", version or "")
    if not m or not rng:
        return None
    return rng[0] <= (int(m[1]), int(m[2])) <= rng[1]


def describe_machine(args, report: Report) -> dict:
    import json
    out = capture([sys.executable, "-c", PROBE], timeout=60)
    try:
        facts = json.loads(out.splitlines()[-1])
    except (ValueError, IndexError):
        facts = {"probe_error": out}
    nvcc = find_nvcc()
    facts["nvcc"] = nvcc
    lines = [
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S UTC}",
        f"- mode: {'**DRY RUN** (CPU only: build without CUDA, toy benchmark sizes)' if args.dry_run else 'GPU'}",
        f"- host: {platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs",
        f"- python: {sys.executable} ({platform.python_version()})",
        f"- torch: {facts.get('torch', '?')} (CUDA {facts.get('torch_cuda')}); "
        f"CUDA available: {facts.get('cuda_available')}",
    ]
    if facts.get("cuda_available"):
        lines.append(f"- device: {facts['device']} (sm_{facts['capability']}, "
                     f"{facts['memory_gib']} GiB; {facts['devices']} visible)")
    smi = capture(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap",
                   "--format=csv,noheader"])
    lines.append(f"- nvidia-smi: {smi.splitlines()[0] if smi else '?'}")
    nv = capture([nvcc, "--version"]).splitlines() if nvcc else ["(no nvcc found)"]
    lines.append(f"- nvcc: {nvcc or '-'}: {nv[-1] if nv else '?'}")
    cmake = tool("cmake")
    lines.append(f"- cmake: {capture([cmake, '--version']).splitlines()[0] if cmake else 'NOT FOUND'}; "
                 f"ninja: {tool('ninja') or 'not found (Unix Makefiles)'}")
    lines.append(f"- peak commit: {commit_line()}")
    rng = supported_torch()
    inside = torch_in_range(facts.get("torch"), rng)
    if rng:
        lines.append(f"- peak's accepted torch range (python/peak/_extension.py): "
                     f"{rng[0][0]}.{rng[0][1]} to {rng[1][0]}.{rng[1][1]}: "
                     + ("this torch is inside it" if inside else
                        "**this torch is outside it: `import peak` refuses it**, so every step "
                        "after the build fails; the widened range (2.10 to 2.15) must be merged "
                        "first"))
    report.add("## Machine\n\n" + "\n".join(lines) + "\n")
    return facts


# ---- step 1: build

def cuda_archs(args, facts) -> str:
    if os.environ.get("PEAK_CUDA_ARCHS"):
        return os.environ["PEAK_CUDA_ARCHS"]
    cap = facts.get("capability")
    return f"{cap}-real" if cap else "90-real"


def build(args, facts, report: Report, log: Path, timeout: float):
    bdir = REPO / ("build/gpu-check-cpu" if args.dry_run else "build/gpu-check")
    cmake, ninja = tool("cmake"), tool("ninja")
    if not cmake:
        report.add("## Build\n\n**FAILED**: no cmake next to the interpreter or on PATH\n")
        return Result(1, 0, False), None
    defs = {"CMAKE_BUILD_TYPE": "Release", "Python_EXECUTABLE": sys.executable,
            "PEAK_CPU_ISA": "native", "PEAK_TEST_TWINS": "ON"}
    if args.dry_run:
        defs["PEAK_CUDA"] = "OFF"
    else:
        defs["PEAK_CUDA"] = "ON"
        defs["PEAK_CUDA_ARCHS"] = cuda_archs(args, facts)
        # (also CMake's own variable, so that its compiler check compiles for the same arch)
        defs["CMAKE_CUDA_ARCHITECTURES"] = defs["PEAK_CUDA_ARCHS"]
        if facts.get("nvcc"):
            defs["CMAKE_CUDA_COMPILER"] = facts["nvcc"]
    configure = [cmake, "-S", REPO, "-B", bdir]
    if ninja:
        configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    configure += [f"-D{k}={v}" for k, v in defs.items()]
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(args.jobs))
    rebuild = (bdir / "CMakeCache.txt").exists()
    t0 = time.monotonic()
    res = run_logged(configure, log, timeout, env)
    if res.ok:
        res = run_logged([cmake, "--build", bdir, "-j", str(args.jobs)], log,
                         timeout - (time.monotonic() - t0), env)
    seconds = time.monotonic() - t0
    res.seconds = seconds
    pkg = None
    if res.ok:
        try:
            pkg = stage(bdir)
        except Exception as e:
            res.rc = 1
            with open(log, "a") as f:
                f.write(f"[gpu_check: staging the package failed: {e}]\n")
    text = (f"## Build\n\n{res.status()} in {seconds:.1f} s "
            f"({'incremental: an existing tree' if rebuild else 'first build of this tree'}), "
            f"{bdir.relative_to(REPO)}, -j{args.jobs}: "
            + ", ".join(f"{k}={v}" for k, v in defs.items() if k.startswith("PEAK_")) + "\n")
    if not res.ok:
        text += "\nEnd of build.log:\n\n" + fence(tail(log, 60))
    report.add(text)
    return res, pkg


def stage(bdir: Path) -> Path:
    """build/.../pkg/peak: links to every file of python/peak plus the built _C module and
    _build_info.py, so that PYTHONPATH=pkg imports this checkout with this build, and source
    edits show without a copy."""
    src = REPO / "python" / "peak"
    pkg = bdir / "pkg"
    dest = pkg / "peak"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for entry in src.iterdir():
        if entry.name == "__pycache__" or entry.name.startswith("_C.") or \
                entry.name == "_build_info.py":
            continue  # a stale in-place build in the source tree must not shadow this one
        (dest / entry.name).symlink_to(entry)
    modules = list(bdir.glob("_C*.so"))
    if len(modules) != 1:
        raise RuntimeError(f"expected one _C*.so in {bdir}, found {modules}")
    (dest / modules[0].name).symlink_to(modules[0])
    (dest / "_build_info.py").symlink_to(bdir / "_build_info.py")
    return pkg


def tail(path: Path, lines: int) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 200_000))
        return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")


# ---- step 2: smoke

SMOKE = r"""
import math, sys, torch
device = sys.argv[1]
import peak
from peak import ops
from peak.optimizers import FusedAdam
print("peak", peak.__version__, "from", peak.__file__)
print("build:", {k: v for k, v in peak._C.build_info().items()
                 if k in ("with_cuda", "cuda_archs", "cuda_version", "cpu_isa", "test_twins")})

# unscale + inf/NaN check on the device
grads = [torch.full((1000,), 2.0, device=device).half(), torch.ones(10, device=device).half()]
found = ops.new_found_inf(device)
ops.multi_tensor_scale_(grads, grads, 0.5, found)
assert found.item() == 0 and grads[0][0].item() == 1.0, (found, grads[0][:3])
grads[1][3] = math.inf
ops.multi_tensor_scale_(grads, grads, 0.5, found)
assert found.item() == 1, found
print("multi_tensor_scale_: unscales, and finds the inf: ok")

# one FusedAdam step (bf16 weights, fp32 masters) on the device, against the CPU and torch
def inputs():
    g = torch.Generator().manual_seed(0)
    shapes = [(257, 33), (4099,), (3,)]
    params = [torch.randn(s, generator=g).mul_(0.5) for s in shapes]
    grads = [torch.randn(s, generator=g).mul_(1e-2).bfloat16() for s in shapes]
    return params, grads

def peak_step(dev):
    params, grads = inputs()
    ps = [p.bfloat16().to(dev).requires_grad_() for p in params]
    for p, g in zip(ps, grads):
        p.grad = g.to(dev)
    opt = FusedAdam(ps, lr=1e-2, weight_decay=0.01, adam_w_mode=True, master_weights=True)
    for _ in range(3):
        opt.step()
    return [p.detach().cpu() for p in ps]

def torch_step():
    params, grads = inputs()
    ps = [p.bfloat16().float().requires_grad_() for p in params]
    for p, g in zip(ps, grads):
        p.grad = g.float()
    opt = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)
    for _ in range(3):
        opt.step()
    return [p.detach().bfloat16() for p in ps]

ok = True
here = peak_step(device)
ref = torch_step()
worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(here, ref))
close = all(torch.allclose(a.float(), b.float(), rtol=1.6e-2, atol=1e-6) for a, b in zip(here, ref))
print(f"FusedAdam x3 on {device} vs torch AdamW (fp32, rounded to bf16): max |diff| {worst:.3g}:",
      "ok" if close else "FAILED")
ok &= close
if device != "cpu":
    cpu = peak_step("cpu")
    same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(here, cpu))
    worst = max((a.float() - b.float()).abs().max().item() for a, b in zip(here, cpu))
    print(f"FusedAdam x3 on {device} vs on the CPU: bit-identical: {same} (max |diff| {worst:.3g}):",
          "ok" if same else "FAILED")
    ok &= same
sys.exit(0 if ok else 1)
"""


def smoke(args, env, report: Report, log: Path, timeout: float) -> Result:
    device = "cpu" if args.dry_run else "cuda"
    t0 = time.monotonic()
    res = run_logged([sys.executable, "-m", "peak.info"], log, timeout, env)
    info_ok = res.ok
    res2 = run_logged([sys.executable, "-c", SMOKE, device], log,
                      timeout - (time.monotonic() - t0), env)
    res2.seconds = time.monotonic() - t0
    if not info_ok and res2.ok:
        res2.rc = res.rc if res.rc else 1
    report.add(f"## Smoke test ({device})\n\n{res2.status()} in {res2.seconds:.1f} s "
               f"(`python -m peak.info`, the unscale + inf check, one FusedAdam step compared "
               f"with torch's AdamW{'' if args.dry_run else ' and bit for bit with the CPU'})\n\n"
               + fence(log.read_text(errors="replace"), 6000))
    return res2


# ---- step 3: the CUDA tests

def parse_junit(path: Path):
    """(counts, [(test id, message)]) from pytest's junit XML, or None when it is missing or
    unreadable (pytest stopped before writing it)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    failures = []
    for case in root.iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        tid = f"{cls}::{name}" if cls else name
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                msg = (child.get("message") or "").strip() or (child.text or "").strip()
                failures.append((tid, outcome, first_lines(msg)))
                break
            if child.tag == "skipped":
                outcome = "skipped"
        counts[outcome] += 1
    return counts, failures


def first_lines(msg: str, n: int = 6, width: int = 300) -> str:
    lines = [ln.rstrip() for ln in msg.strip().splitlines() if ln.strip()][:n]
    return " / ".join(ln[:width] for ln in lines)


_VERBOSE = re.compile(r"^(\S+::\S.*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$")


def parse_pytest_log(text: str):
    """What a pytest log (-v, -rfE) says when there is no junit XML (a stopped run): the
    outcome of each test that finished, the failures' one-line messages from the short summary,
    and the test that was running when it stopped."""
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    failures, seen, last_started = {}, set(), None
    for line in text.splitlines():
        m = _VERBOSE.match(line)
        if m:
            tid, outcome = m[1], m[2]
            last_started = None
            key = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "error",
                   "SKIPPED": "skipped", "XFAIL": "skipped"}[outcome]
            if (tid, key) not in seen:
                seen.add((tid, key))
                counts[key] += 1
            if key in ("failed", "error"):
                failures.setdefault(tid, (key, ""))
            continue
        m = _SUMMARY.match(line)
        if m:
            key = "failed" if m[1] == "FAILED" else "error"
            failures[m[2]] = (key, (m[3] or "").strip())
            continue
        if "::" in line and not line.startswith(" "):
            last_started = line.split()[0]
    return counts, [(t, k, msg) for t, (k, msg) in failures.items()], last_started


_COLLECTING = re.compile(r"^_+ ERROR collecting (\S+) _+$")
# A test module that imports a package this machine lacks (sphinx, nbclient: tests/docs,
# tests/examples) holds no CUDA test: its collection error is reported, not failed on. Any other
# collection error (peak itself failing to import, a syntax error) fails the check.
_MISSING_DEPENDENCY = re.compile(r"No module named '(?!peak\b)[^']+'")


def collection_reasons(text: str) -> dict:
    """{test module path: first error line} of pytest's "ERROR collecting" blocks."""
    reasons, current = {}, None
    for line in text.splitlines():
        m = _COLLECTING.match(line.strip())
        if m:
            current = m[1]
            continue
        if current and line.startswith("E   "):
            reasons.setdefault(current, line[4:].strip())
        elif current and line.startswith("____"):
            current = None
    return reasons


def split_collection_errors(failures, text):
    """(test failures, [(module, reason, missing dependency?)]) from the failures parsed."""
    reasons = collection_reasons(text)
    tests, modules = [], []
    for tid, kind, msg in failures:
        if msg == "collection failure" or (kind == "error" and "::" not in tid):
            path = tid if tid.endswith(".py") else tid.replace(".", "/") + ".py"
            reason = reasons.get(path, msg)
            modules.append((path, reason, bool(_MISSING_DEPENDENCY.search(reason))))
        else:
            tests.append((tid, kind, msg))
    return tests, modules


def cuda_tests(args, env, report: Report, out: Path, timeout: float) -> Result:
    log, junit = out / "pytest.log", out / "junit.xml"
    junit.unlink(missing_ok=True)
    env = dict(env, PYTHONPATH=os.pathsep.join([str(REPO / "tools"), env["PYTHONPATH"]]))
    cmd = [sys.executable, "-m", "pytest", "-p", "gpu_check_select", "-p", "no:cacheprovider",
           "-v", "-rfE", "--tb=short", "--continue-on-collection-errors",
           f"--junitxml={junit}", "tests"]
    has_timeout = capture([sys.executable, "-c", "import pytest_timeout"], env=env) \
        .startswith("(no output")
    if has_timeout:
        cmd[-1:-1] = [f"--timeout={args.per_test_timeout}"]
    # A test that crashes the interpreter (a segfault in a kernel entry) would end the run and
    # hide every test after it: the run resumes without the tests already done, at most
    # MAX_CRASHES times, and the crash is reported as that test's failure.
    t0, crashed, done, earlier = time.monotonic(), [], [], []
    while True:
        start = log.stat().st_size if log.exists() else 0
        deselect = [f"--deselect={t}" for t in crashed + done]
        res = run_logged(cmd[:-1] + deselect + cmd[-1:], log, timeout - (time.monotonic() - t0),
                         env)
        with open(log, "rb") as f:
            f.seek(start)
            segment = f.read().decode(errors="replace")
        crash = re.search(r"^(\S+::\S+) Fatal Python error: (.*)$", segment, re.M)
        if res.timed_out or not crash:
            break
        counts_here, failures_here, _ = parse_pytest_log(segment)
        done += [m[1] for m in map(_VERBOSE.match, segment.splitlines()) if m]
        crashed.append(crash[1])
        earlier.append((counts_here, failures_here + [
            (crash[1], "failed", f"crashed the interpreter: {crash[2].strip()} (pytest.log has "
                                 "the stack; the run resumed after it)")]))
        if len(crashed) > MAX_CRASHES:
            break
    res.seconds = time.monotonic() - t0
    text = log.read_text(errors="replace")
    last = None
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    failures = []
    if crash:  # the last run crashed too: everything is in `earlier`
        source = f"pytest.log (stopped after {len(crashed)} crashes)"
    elif (parsed := parse_junit(junit)) is None:
        counts, failures, last = parse_pytest_log(segment)
        source = "pytest.log (no junit.xml: pytest did not finish)"
    else:
        counts, failures = parsed
        source = "junit.xml"
    for counts_here, failures_here in earlier:
        for k in counts:
            counts[k] += counts_here[k]
        counts["failed"] += 1  # the crashed test
        failures = failures_here + failures
    if crashed and not crash:
        source += f"; resumed after {len(crashed)} crash(es)"
    failures, modules = split_collection_errors(failures, text)
    if parsed is not None:  # junit counts a module's collection error as an error (the log not)
        counts["error"] -= len(modules)
    broken = [m for m in modules if not m[2]]
    # pytest's exit codes: 0 all passed, 1 some failed (or a module was not collected), 5 nothing
    # collected (no CUDA test selected: a failure of the check, not a pass).
    ok = (not res.timed_out and not crashed and res.rc in (0, 1) and not failures and not broken
          and counts["failed"] == 0 and counts["error"] == 0)
    status = ("ok" if ok else "FAILED (a test crashed the interpreter)" if crashed and not
              res.timed_out else res.status() if res.rc != 5
              else "FAILED (exit 5: no CUDA test was selected)")
    lines = [f"## CUDA tests\n\n{status} in {res.seconds:.1f} s; from {source}: "
             f"{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
             f"{counts['skipped']} skipped"
             + (f"; per-test limit {args.per_test_timeout} s (pytest-timeout)" if has_timeout
                else "; no per-test limit (pytest-timeout not installed)")]
    if args.dry_run and counts["skipped"] and not counts["passed"]:
        lines.append("\n(dry run: no CUDA device, so the selected tests skip; the selection and "
                     "its report are what this checks)")
    if res.timed_out:
        lines.append(f"\n**The run was stopped at its time limit**"
                     + (f"; the test running then: `{last}`" if last else "") + ".")
    if failures:
        lines.append("\n| test | outcome | message |\n|---|---|---|")
        for tid, kind, msg in failures:
            lines.append(f"| `{tid}` | {kind} | {msg.replace('|', '/') or '(see pytest.log)'} |")
    elif not ok and not res.timed_out and not broken:
        lines.append("\nEnd of pytest.log:\n\n" + fence(tail(log, 40)))
    if modules:
        lines.append("\nTest modules not collected (a missing package this check does not "
                     "need is reported only; anything else fails it):\n\n| module | reason | "
                     "fails the check |\n|---|---|---|")
        for path, reason, missing in modules:
            lines.append(f"| `{path}` | {reason.replace('|', '/')[:300]} | "
                         f"{'no (a missing package)' if missing else '**yes**'} |")
    report.add("\n".join(lines) + "\n")
    cap_file(junit)
    return Result(0 if ok else (res.rc or 1), res.seconds, res.timed_out)


# ---- step 4: benchmarks

def bench(args, env, report: Report, out: Path, timeout: float) -> Result:
    md, log = out / "bench.md", out / "bench.log"
    md.write_text("")
    cmd = [sys.executable, REPO / "benchmarks/bench_gpu.py", "--out", md,
           "--deadline-s", f"{max(timeout - 20, 1):.0f}"]
    cmd += ["--device", "cpu", "--tiny"] if args.dry_run else ["--device", "cuda"]
    if args.bench_args:
        cmd += args.bench_args.split()
    res = run_logged(cmd, log, timeout, env)
    tables = md.read_text(errors="replace")
    text = f"## Benchmarks (benchmarks/bench_gpu.py)\n\n{res.status()} in {res.seconds:.1f} s\n"
    text += tables or "\n(no table was written)\n"
    if not res.ok:
        text += "\nEnd of bench.log:\n\n" + fence(tail(log, 40))
    report.add(text)
    return res


# ---- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT") or "build/gpu-check-report",
                   help="folder of the report and its logs (default: $GPU_CHECK_OUT or "
                        "build/gpu-check-report)")
    p.add_argument("--dry-run", action="store_true",
                   default=os.environ.get("DRY_RUN", "") in ("1", "yes", "true"),
                   help="no GPU: CPU-only build, smoke test on the CPU, toy benchmark sizes")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--budget-s", type=float, default=290,
                   help="the whole run's limit; a step gets at most what is left of it")
    p.add_argument("--build-timeout", type=float, default=240)
    p.add_argument("--smoke-timeout", type=float, default=60)
    p.add_argument("--test-timeout", type=float, default=100)
    p.add_argument("--per-test-timeout", type=int, default=60)
    p.add_argument("--bench-timeout", type=float, default=120)
    p.add_argument("--bench-args", default="", help="extra arguments of bench_gpu.py")
    p.add_argument("--skip", default="", help=f"steps to leave out, comma-separated: {STEPS}")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    out = Path(args.out)
    if not out.is_absolute():
        out = REPO / out
    out.mkdir(parents=True, exist_ok=True)
    skip = {s for s in args.skip.split(",") if s}
    if skip - set(STEPS):
        sys.exit(f"gpu_check: unknown steps in --skip: {sorted(skip - set(STEPS))}")
    for name in ("build.log", "smoke.log", "pytest.log", "bench.log"):
        (out / name).write_text("")
    report = Report(out / "report.md")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal(report))
    report.add(f"# peak gpu-check{' (DRY RUN)' if args.dry_run else ''}\n\n"
               f"`{' '.join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:]))}`; "
               f"budget {args.budget_s:.0f} s. Beside this file: build.log, smoke.log, pytest.log, "
               f"junit.xml, bench.md, bench.log.\n")

    def left(cap):
        return min(cap, args.budget_s - (time.monotonic() - start))

    summary = []
    facts = describe_machine(args, report)
    if not args.dry_run and not facts.get("cuda_available"):
        report.add("**No CUDA device is visible to torch**: the GPU steps cannot run. "
                   "(`--dry-run` checks this script on a CPU.)\n")
        summary.append(("device", "FAILED (no CUDA device)", 0.0))

    env = dict(os.environ)
    pkg = None
    if "build" in skip:
        bdir = REPO / ("build/gpu-check-cpu" if args.dry_run else "build/gpu-check")
        pkg = bdir / "pkg" if (bdir / "pkg" / "peak").exists() else None
        summary.append(("build", "skipped", 0.0))
    else:
        res, pkg = build(args, facts, report, out / "build.log", left(args.build_timeout))
        summary.append(("build", res.status(), res.seconds))
    if pkg is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(pkg)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # keep __pycache__ out of python/peak's links
        steps = [("smoke", lambda t: smoke(args, env, report, out / "smoke.log", t),
                  args.smoke_timeout),
                 ("tests", lambda t: cuda_tests(args, env, report, out, t), args.test_timeout),
                 ("bench", lambda t: bench(args, env, report, out, t), args.bench_timeout)]
        for name, fn, cap in steps:
            if name in skip:
                summary.append((name, "skipped", 0.0))
                continue
            t = left(cap)
            if t < 5:
                report.add(f"## {name}\n\nnot run: the budget of {args.budget_s:.0f} s is spent\n")
                summary.append((name, "not run (budget spent)", 0.0))
                continue
            res = fn(t)
            summary.append((name, res.status(), res.seconds))
    else:
        report.add("Nothing to test: the build failed (or was skipped with no earlier build).\n")

    total = time.monotonic() - start
    rows = "\n".join(f"| {n} | {s} | {sec:.1f} |" for n, s, sec in summary)
    failed = [n for n, s, _ in summary if s not in ("ok", "skipped")]
    report.add(f"## Summary\n\n| step | status | seconds |\n|---|---|---|\n{rows}\n\n"
               f"Total {total:.1f} s. "
               + ("**All steps passed.**" if not failed else f"**Failed: {', '.join(failed)}.**")
               + "\n")
    for f in out.iterdir():
        cap_file(f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
