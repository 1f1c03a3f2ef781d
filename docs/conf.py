"""Sphinx configuration of peak's documentation site.

Build: ``make docs`` (or ``sphinx-build -W -b html docs docs/_build/html``); warnings are errors.
Pages are Markdown (MyST); the API reference is generated from the docstrings of the installed
``peak`` package, so build in the environment where peak is installed.
"""
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "python"))  # a source checkout without an install: autodoc still imports

project = "peak"
author = "the peak developers"
copyright = "the peak developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_generated/README*", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_static_path = ["_static"]
html_title = "peak: mixed-precision training for PyTorch"

# The benchmark page includes the lead's benchmarks/README.md (numbers and the commands that produced
# them). Until that file exists the page says so instead of failing the build.
_generated = HERE / "_generated"
_generated.mkdir(exist_ok=True)
_bench = ROOT / "benchmarks" / "README.md"
_bench_text = (_bench.read_text() if _bench.exists() else
               "*No recorded results yet: `benchmarks/README.md` will hold them. Run the commands above "
               "to measure on your machine.*\n")
_target = _generated / "benchmark_results.md"
if not _target.exists() or _target.read_text() != _bench_text:
    _target.write_text(_bench_text)
exclude_patterns.append("_generated/*")
