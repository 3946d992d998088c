"""The notebooks run and are kept in git without outputs.

notebooks/inspect_gates.ipynb runs top to bottom (it trains its own two small digits runs),
notebooks/your_own_prior.ipynb trains a few steps with a prior written in one of its cells and reads the run back, and
both are kept in git without outputs."""

import json
import math
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "inspect_gates.ipynb"
OWN_PRIOR = NOTEBOOK.with_name("your_own_prior.ipynb")


def _executed(path: Path, tmp_path, monkeypatch) -> tuple[nbformat.NotebookNode, str]:
    """The notebook at ``path`` run top to bottom from ``tmp_path/notebooks/``, and the text its code cells printed.

    A notebook trains into ``runs/`` of the checkout it sits in (the folder above ``notebooks/``): here ``tmp_path``,
    the installed package being the one tested.
    """
    nb = nbformat.read(path, as_version=4)
    (tmp_path / "notebooks").mkdir()
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path / "notebooks")}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "IProgress" not in text  # issue 53, item 11: tqdm's warning, through pyro's import of tqdm.auto
    return nb, text


@pytest.mark.parametrize("notebook", [NOTEBOOK, OWN_PRIOR], ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(notebook):
    nb = nbformat.read(notebook, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    nb, text = _executed(NOTEBOOK, tmp_path, monkeypatch)
    assert "dims most specific to one class" in text and "conflict (bayesncl)" in text and "conflict (ncl)" in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 5
    work = tmp_path / "runs" / "notebook-inspect-gates"  # issue 53, item 11: a folder the user finds, and is told
    assert len(list(work.glob("bayesncl/inspect/*.png"))) == 6 and f"the runs are in {work}/" in text
    # the report inline, then one card on its own, each in an iframe of its own
    pages = [html for c in nb.cells if c.cell_type == "code" for o in c.outputs
             if (html := o.get("data", {}).get("text/html", "")).startswith("<iframe srcdoc=")]
    assert len(pages) == 2 and "&quot;dim/" not in pages[0] and "&quot;dim/" in pages[1]
    assert (work / "bayesncl" / "report" / "index.html").exists()


def test_a_prior_written_in_a_notebook_cell_trains_exports_and_reports(tmp_path, monkeypatch):
    _, text = _executed(OWN_PRIOR, tmp_path, monkeypatch)
    assert "p(g) for 3 rows: batch (3,), event (8,)" in text
    assert "posterior draws of the rates: {'chain': 1, 'draw': 10, 'feature': 64}" in text
    assert "q's parameters: ['rate_a', 'rate_b']" in text
    assert "report of a __main__:KumaraswamyRates run: prior rate 0." in text
    run = tmp_path / "runs" / "notebook-own-prior"  # issue 53, item 11: a folder the user finds, and is told
    assert f"the run is in {run}/" in text
    assert (run / "gates.nc").exists() and (run / "report" / "index.html").exists()
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert log and all(math.isfinite(r["kl"]) and r["kl"] > 0 for r in log)  # the rates' KL a draw, the gates' exact
    # a prior with correlated gates and no guide of its own, under ste and leg; a discrete latent summed out
    for gate in ("ste", "leg"):
        assert (f"{gate}: guide AutoNormal; KL per site: {{'logits': 'Monte Carlo, one pathwise draw', 'g': "
                "'analytic', 'logits_unconstrained': 'Monte Carlo, one pathwise draw'}") in text
        assert (run.parent / f"correlated-{gate}" / "eval.json").is_file()
    assert "KL per site: {'g': 'Monte Carlo, local expectation per gate'}" in text
    assert (run.parent / "sparse-or-dense" / "eval.json").is_file()
