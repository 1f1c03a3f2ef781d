"""A wheel of peak, built with `pip wheel --no-build-isolation .`, installs into a fresh venv,
passes the kernel test files with the CPU level forced to baseline (what a wheel built here meets
on the oldest machines), gives the same bits at every level this CPU runs (the level test file,
whose optimizer runs cover each kind of kernel instantiation: moments in fp32, bf16 and 8 bits,
remainders, stochastic rounding, gradients stored back or not), and reports each forced level.
See docs/build.md.

The wheel is made in the build tree this installation came from (`-C build-dir=...`), so the
compile is incremental (seconds); without one (an installed wheel), in a temporary tree. The
venv gets the wheel with --no-deps and borrows torch, numpy and pytest from this environment
through a .pth file: the point is peak's wheel, not a second 750 MB torch install.
"""
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from peak import _build_info, ops

REPO = Path(__file__).resolve().parents[2]
KERNEL_TESTS = ["tests/ops/test_multi_tensor_ops.py", "tests/optimizers/test_fused_optimizers.py",
                "tests/optimizers/test_stochastic_rounding.py", "tests/optimizers/test_fused_clipping.py"]
LEVELS = ops.cpu_levels()


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEAK_")}
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", "2")
    env.update(extra)
    return env


def _reusable_build_dir():
    """This installation's build tree, if it was configured from this checkout."""
    build_dir = Path(getattr(_build_info, "build_dir", "") or "/nonexistent")
    cache = build_dir / "CMakeCache.txt"
    if cache.is_file() and f"CMAKE_HOME_DIRECTORY:INTERNAL={REPO}" in cache.read_text():
        return build_dir
    return None


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    build_dir = _reusable_build_dir() or tmp / "build"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                        "-w", str(tmp / "dist"), "-C", f"build-dir={build_dir}", str(REPO)],
                       capture_output=True, text=True, env=_clean_env())
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    wheels = list((tmp / "dist").glob("peak-*.whl"))
    assert len(wheels) == 1, wheels
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert any(re.match(r"peak/_C\..*\.so$", n) for n in names), names
    assert "peak/_build_info.py" in names and "peak/ops.py" in names

    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                        "--no-deps", "--no-index", str(wheels[0])],
                       capture_output=True, text=True, env=_clean_env())
    assert r.returncode == 0, f"pip install of the wheel failed:\n{r.stdout}\n{r.stderr}"
    # torch, numpy, pytest, hypothesis from this environment, after the venv's own packages.
    venv_site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                     "get_paths()['purelib'])"], capture_output=True, text=True,
                                    check=True).stdout.strip())
    (venv_site / "zz_borrowed_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = subprocess.run([str(python), "-c", "import peak, sys; print(peak.__file__)"],
                           capture_output=True, text=True, env=_clean_env(), cwd=REPO)
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(venv_site)), where.stdout
    return python


def _run_in_wheel(wheel_venv, args, env):
    r = subprocess.run([str(wheel_venv), "-m", "pytest", "-x", "-p", "no:cacheprovider", *args],
                       capture_output=True, text=True, env=env, cwd=REPO)
    tail = "\n".join(r.stdout.splitlines()[-12:])
    assert r.returncode == 0, f"{args} failed in the wheel's venv:\n{tail}\n{r.stderr[-2000:]}"
    assert f"peak from {wheel_venv.parent.parent}" in r.stdout[:3000], r.stdout[:3000]
    assert re.search(r"\d+ passed", tail), tail
    return r.stdout


@pytest.mark.parametrize("level", LEVELS["compiled"])
def test_wheel_reports_each_forced_level(wheel_venv, level):
    if level not in LEVELS["supported"]:
        pytest.skip(f"this CPU does not run level {level}")
    info = subprocess.run([str(wheel_venv), "-m", "peak.info"], capture_output=True, text=True,
                          env=_clean_env(PEAK_CPU_LEVEL=level), cwd=REPO)
    assert info.returncode == 0, info.stderr
    assert re.search(rf"^cpu_level +{level} \(forced by PEAK_CPU_LEVEL={level}\)$", info.stdout,
                     re.M), info.stdout


def test_wheel_passes_kernel_tests_at_the_baseline_level(wheel_venv):
    level = LEVELS["compiled"][0]
    out = _run_in_wheel(wheel_venv, KERNEL_TESTS, _clean_env(PEAK_CPU_LEVEL=level))
    assert f"peak CPU level: {level} (forced by PEAK_CPU_LEVEL" in out[:3000], out[:3000]


def test_wheel_passes_the_level_tests(wheel_venv):
    """The level test file in the wheel's venv; where this CPU runs two levels or more, its
    same-bits tests ran there (a CPU with one level has nothing to compare)."""
    out = _run_in_wheel(wheel_venv, ["-v", "tests/ops/test_cpu_levels.py"], _clean_env())
    if len(LEVELS["supported"]) >= 2:
        for name in ("elementwise_ops", "fused_optimizers", "nan_payloads_convert_alike"):
            assert re.search(rf"test_{name}\w*_at_every_level PASSED", out), out[-3000:]
