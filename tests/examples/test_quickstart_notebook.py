"""examples/quickstart.ipynb executes top to bottom (nbclient, a fresh kernel on this Python), so it
cannot rot. The committed notebook has no outputs; this run keeps its outputs in memory only."""
import os
import pathlib
import re

try:
    import nbclient
    import nbformat
except ImportError as err:  # a hard failure, not a skip: the notebook must never go untested
    raise ImportError(f"{err}: the notebook test needs nbclient, nbformat and ipykernel "
                      "(in the Makefile's DEPS; pip install nbclient nbformat ipykernel)") from None

NOTEBOOK = pathlib.Path(__file__).resolve().parents[2] / "examples" / "quickstart.ipynb"


def test_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, "strip the outputs before committing"


def test_quickstart_notebook_executes(monkeypatch):
    monkeypatch.setenv("QUICKSTART_STEPS", "12")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError with the cell's traceback if any cell fails
    text, images = "", 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text += out.get("text", "")
            images += "image/png" in out.get("data", {})
    assert images >= 1  # the loss / loss-scale figure
    runs = dict(re.findall(r"^(O[012]): loss (\S+ -> \S+),", text, flags=re.M))
    assert set(runs) == {"O0", "O1", "O2"}
    for level, change in runs.items():
        first, last = (float(v) for v in change.split(" -> "))
        assert last < first, (level, change)
    assert "O2 bf16" in text
