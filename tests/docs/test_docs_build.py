"""The documentation site builds with warnings as errors (what `make docs` and CI run)."""
import pathlib
import subprocess
import sys

try:
    import myst_parser  # noqa: F401
    import sphinx  # noqa: F401
except ImportError as err:  # a hard failure, not a skip: the site must never go unbuilt
    raise ImportError(f"{err}: the docs build needs sphinx and myst-parser "
                      "(in the Makefile's DEPS; pip install sphinx myst-parser)") from None

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def test_sphinx_build_warnings_are_errors(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q", "-b", "html", str(DOCS),
         str(tmp_path / "html")],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    html = tmp_path / "html"
    for page in ("index", "quickstart", "opt_levels", "advanced", "torch_dialect", "migrating", "checkpointing",
                 "integrations", "logging", "examples", "core", "build", "amp_api", "benchmarks", "api"):
        assert (html / f"{page}.html").exists(), page
    api = (html / "api.html").read_text()
    for name in ("peak.amp.initialize", "peak.amp.scale_loss", "peak.amp.GradScaler", "peak.ops.multi_tensor_scale_"):
        assert f'id="{name}"' in api, f"{name} missing from the API reference"
