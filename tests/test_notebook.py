"""The notebooks run and are kept in git without outputs.

notebooks/inspect_gates.ipynb runs top to bottom (it trains its own two small digits runs),
notebooks/your_own_prior.ipynb trains a few steps with priors written in its cells and reads the run back, and
both are kept in git without outputs. A notebook that passed its test is written executed to the documentation site's
folder of executed notebooks (docs/_ext/bayesncl_docs.py, EXECUTED), whose build shows it as it ran here."""

import json
import math
from pathlib import Path

import nbformat
import pytest
from helpers import ROOT, docs_extension

NOTEBOOK = ROOT / "notebooks" / "inspect_gates.ipynb"
OWN_PRIOR = NOTEBOOK.with_name("your_own_prior.ipynb")


def _publish(nb: nbformat.NotebookNode, path: Path):
    """The executed notebook, for the documentation site to show without running it again."""
    folder = docs_extension().EXECUTED
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, folder / path.name)


@pytest.mark.parametrize("notebook", [NOTEBOOK, OWN_PRIOR], ids=lambda p: p.stem)
def test_notebook_is_stored_without_outputs(notebook):
    nb = nbformat.read(notebook, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(executed_notebook):
    nb, text, tmp_path = executed_notebook(NOTEBOOK)
    assert "IProgress" not in text  # tqdm's warning, through pyro's import of tqdm.auto
    assert "dims most specific to one class" in text and "conflict (bayesncl)" in text and "conflict (ncl)" in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 5
    # a folder the user finds, and is told (relative: no machine's path)
    work = tmp_path / "runs" / "notebook-inspect-gates"
    assert len(list(work.glob("bayesncl/inspect/*.png"))) == 6
    assert "the runs are in runs/notebook-inspect-gates/" in text
    # the report inline, then one card on its own, each in an iframe of its own
    pages = [html for c in nb.cells if c.cell_type == "code" for o in c.outputs
             if (html := o.get("data", {}).get("text/html", "")).startswith("<iframe srcdoc=")]
    assert len(pages) == 2 and "&quot;dim/" not in pages[0] and "&quot;dim/" in pages[1]
    assert (work / "bayesncl" / "report" / "index.html").exists()
    _publish(nb, NOTEBOOK)


def test_a_prior_written_in_a_notebook_cell_trains_exports_and_reports(executed_notebook):
    nb, text, tmp_path = executed_notebook(OWN_PRIOR)
    assert "IProgress" not in text
    assert "p(g) for 3 rows: batch (3,), event (8,)" in text
    assert "posterior draws of the rates: {'chain': 1, 'draw': 10, 'feature': 64}" in text
    assert "q's parameters: ['rate_a', 'rate_b']" in text
    assert "report of a __main__:KumaraswamyRates run: prior rate 0." in text
    run = tmp_path / "runs" / "notebook-own-prior"  # a folder the user finds, and is told (relative: no machine's path)
    assert "the run is in runs/notebook-own-prior/" in text
    assert (run / "gates.nc").exists() and (run / "report" / "index.html").exists()
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert log and all(math.isfinite(r["kl"]) and r["kl"] > 0 for r in log)  # the rates' KL a draw, the gates' exact
    # a prior with correlated gates and no guide of its own, under ste and leg; a discrete latent summed out
    for gate in ("ste", "leg"):
        assert (f"{gate}: guide AutoNormal; KL per site: {{'logits': 'Monte Carlo, one pathwise draw', 'g': "
                "'analytic', 'logits_unconstrained': 'Monte Carlo, one pathwise draw'}") in text
    assert "KL per site: {'g': 'Monte Carlo, local expectation per gate'}" in text
    for name in ("notebook-correlated-ste", "notebook-correlated-leg", "notebook-sparse-or-dense"):  # trained
        log = [json.loads(line) for line in (run.parent / name / "log.jsonl").read_text().splitlines()]
        assert log and all(math.isfinite(r["loss"]) and math.isfinite(r["kl"]) for r in log), name
    _publish(nb, OWN_PRIOR)
