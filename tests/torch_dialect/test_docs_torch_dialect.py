"""Every ```python block of docs/torch_dialect.md runs as written."""
import pathlib
import re

import pytest
import torch

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "torch_dialect.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_snippet_runs(code):
    exec(compile(code, str(DOC), "exec"), {"torch": torch})
    assert not torch.is_autocast_enabled("cpu")
