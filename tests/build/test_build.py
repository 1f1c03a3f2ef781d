"""The package knows what it was built with, and refuses clearly to load a mismatched build."""
import re
import subprocess
import sys

import pytest
import torch

import peak
from peak import _extension


def test_build_info_matches_running_torch():
    info = peak._C.build_info()
    assert info["torch_version"] == torch.__version__
    assert info["peak_version"] == peak.__version__
    from peak import _build_info
    assert _build_info.torch_version == torch.__version__
    assert _build_info.with_cuda == info["with_cuda"]
    if info["with_cuda"]:
        assert info["cuda_version"].split(".")[0] == torch.version.cuda.split(".")[0]
        assert info["cuda_archs"]


def test_python_m_peak_info_prints_the_facts():
    out = subprocess.run([sys.executable, "-m", "peak.info"], check=True, capture_output=True,
                         text=True).stdout
    assert f"torch_version          {torch.__version__}" in out
    assert "with_cuda" in out and "cuda_archs" in out


@pytest.mark.parametrize("version", ["2.9.1", "2.16.0", "3.0.0", "1.13.1+cu117"])
def test_unsupported_torch_is_refused(version):
    with pytest.raises(ImportError, match="peak supports torch 2.10 to 2.15, but torch " + re.escape(version)):
        _extension.check_torch_version(version)


@pytest.mark.parametrize("version", ["2.10.0", "2.11.0+cu130", "2.12.1", "2.13.0", "2.13.0+cpu",
                                     "2.14.1+cu130", "2.15.0"])
def test_supported_torch_is_accepted(version):
    _extension.check_torch_version(version)


def test_mismatched_build_names_both_versions_and_the_fix(monkeypatch):
    from peak import _build_info
    monkeypatch.setattr(_build_info, "torch_version", "2.13.0+cu999")
    with pytest.raises(ImportError) as info:
        _extension.load_extension()
    msg = str(info.value)
    assert "2.13.0+cu999" in msg and torch.__version__ in msg
    assert "pip install --no-build-isolation -e ." in msg


def test_missing_build_says_how_to_build(monkeypatch):
    monkeypatch.setitem(sys.modules, "peak._build_info", None)
    monkeypatch.delattr(peak, "_build_info", raising=False)
    with pytest.raises(ImportError, match=r"not built.*pip install --no-build-isolation"):
        _extension.load_extension()


def test_subpackages_load_on_first_use():
    """`import peak; peak.amp.GradScaler(...)` as `import torch; torch.amp...`: the subpackages
    are attributes of peak that load when first used (and not before: `import peak` stays
    light); a name that is not one of them is an AttributeError naming it."""
    code = ("import sys, peak; assert 'peak.amp' not in sys.modules; "
            "print(peak.amp.GradScaler.__module__, peak.optimizers.FusedAdam.__name__); "
            "assert 'peak.amp' in sys.modules\n"
            "try:\n    peak.nonexistent\nexcept AttributeError as e:\n    print(e)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["peak.amp.grad_scaler FusedAdam",
                                     "module 'peak' has no attribute 'nonexistent'"]
