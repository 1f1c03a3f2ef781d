"""Every ```python block of the documentation site (docs/*.md) runs as written.

A page's blocks run in order in one namespace (a page may build on its earlier blocks), in a fresh
amp state, with the working directory set to a temporary folder. README.md's blocks are run by
tests/docs/test_docs_snippets.py. Blocks that are not meant to run use another fence (```text, ```bash).
"""
import logging
import pathlib
import re

import pytest
import torch

from peak.amp import _caster, lists
from peak.amp._amp_state import _amp_state

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
PAGES = sorted(p for p in DOCS.glob("*.md"))


def python_blocks(path):
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def test_site_pages_have_code():
    counts = {p.name: len(python_blocks(p)) for p in PAGES}
    for page in ("quickstart.md", "opt_levels.md", "advanced.md", "migrating.md", "checkpointing.md",
                 "logging.md"):
        assert counts.get(page), f"docs/{page} lost its python examples"


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_page_code_runs(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _caster.disable()
    _amp_state.reset()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loggers = _peak_loggers()
    namespace = {"__name__": "__docs__"}
    try:
        for i, block in enumerate(python_blocks(page)):
            if "Accelerator(" in block:
                _start_accelerate_afresh()
            exec(compile(block, f"docs/{page.name}[python block {i}]", "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
        _caster.disable()
        _amp_state.reset()
        lists.reset()  # (a page's list edits and registrations stay on it)
        _restore_peak_loggers(loggers)


def _peak_loggers() -> dict:
    """peak's loggers as they are (docs/logging.md turns peak.amp's INFO records on: left on,
    later tests would see the host reads the skip log makes)."""
    names = ["peak"] + [n for n in logging.root.manager.loggerDict if n.startswith("peak.")]
    return {n: (logging.getLogger(n).level, list(logging.getLogger(n).handlers),
                logging.getLogger(n).propagate) for n in names}


def _restore_peak_loggers(saved: dict) -> None:
    for name in ["peak"] + [n for n in logging.root.manager.loggerDict if n.startswith("peak.")]:
        logger = logging.getLogger(name)
        level, logger.handlers, logger.propagate = saved.get(name, (logging.NOTSET, [], True))
        logger.setLevel(level)  # (setLevel, not .level: the loggers' cached levels follow)


def _start_accelerate_afresh():
    """A block that builds an Accelerator is a new script for Accelerate, whose state is a
    process-wide singleton that refuses another mixed_precision (docs/integrations.md shows both)."""
    from accelerate.state import AcceleratorState, GradientState  # noqa: PLC0415

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
