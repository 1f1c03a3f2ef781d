"""Every ```python block of README.md runs as written (so the README cannot drift)."""
import pathlib
import re

import pytest

from peak.amp import _caster
from peak.amp._amp_state import _amp_state

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md"]


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


CASES = [(doc, i, block) for doc in DOCS for i, block in enumerate(python_blocks(doc))]


def test_readme_has_snippets():
    assert CASES, "README.md lost its python examples"


@pytest.mark.parametrize("doc,index,code", CASES, ids=[f"{d.name}#{i}" for d, i, _ in CASES])
def test_snippet_runs(doc, index, code):
    try:
        exec(compile(code, f"{doc.name}[block {index}]", "exec"), {"__name__": "__snippet__"})
    finally:  # (a block's amp.initialize is over with it, as tests/docs/test_docs_code.py's are)
        _caster.disable()
        _amp_state.reset()
