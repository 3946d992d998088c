"""notebooks/inspect_gates.ipynb runs top to bottom (it trains its own two small digits runs) and is kept in
git without outputs."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "inspect_gates.ipynb"


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook trains its runs in a temporary folder
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "dims most specific to one class" in text and "conflict (bayesncl)" in text and "conflict (ncl)" in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 5
    assert len(list(tmp_path.glob("inspect_gates_*/bayesncl/inspect/*.png"))) == 6
    # the report inline, then one card on its own, each in an iframe of its own
    pages = [html for c in nb.cells if c.cell_type == "code" for o in c.outputs
             if (html := o.get("data", {}).get("text/html", "")).startswith("<iframe srcdoc=")]
    assert len(pages) == 2 and "&quot;dim/" not in pages[0] and "&quot;dim/" in pages[1]
    assert len(list(tmp_path.glob("inspect_gates_*/bayesncl/report/index.html"))) == 1
