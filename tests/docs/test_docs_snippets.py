"""Every ```python block of README.md runs as written (so the README cannot drift)."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md"]


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


CASES = [(doc, i, block) for doc in DOCS for i, block in enumerate(python_blocks(doc))]


def test_readme_has_snippets():
    assert CASES, "README.md lost its python examples"


@pytest.mark.parametrize("doc,index,code", CASES, ids=[f"{d.name}#{i}" for d, i, _ in CASES])
def test_snippet_runs(doc, index, code):
    exec(compile(code, f"{doc.name}[block {index}]", "exec"), {"__name__": "__snippet__"})
