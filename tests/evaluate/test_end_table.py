"""The end-of-run table: one row a metric, one column a representation (it was about 60 rows, the
controls' rows under the "gated" column)."""

import json

from helpers import ROOT

from bayesncl_pyro.evaluate.heldout import format_table

RECORDS = ROOT / "docs" / "results" / "verdict-comp"


def test_a_gated_runs_controls_are_columns_not_rows():
    results = json.loads((RECORDS / "bayesncl-ste-seed0" / "eval.json").read_text())
    lines = format_table(results).splitlines()
    header, rows = lines[1].split(), {line.split()[0]: line.split()[1:] for line in lines[2:-1]}
    assert header == ["gated", "ungated", "q's", "mean", "q", "draws", "random", "mask"]
    assert len(lines) < 40 and not any(k.endswith(("_random_mask", "_posterior_mean", "_q_draws", "_ungated"))
                                       or k.startswith("ungated_") for k in rows)
    assert rows["semantic_consistency"] == ["0.2114", "0.1734", "0.1734", "0.1845", "0.1810"]
    assert rows["dims_tracking_background"][:2] == ["48", "49"]  # F's and u's, side by side


def test_an_ncl_run_has_one_column():
    lines = format_table(json.loads((RECORDS / "ncl-seed0" / "eval.json").read_text())).splitlines()
    assert "gated" not in lines[1] and all(len(line.split()) == 2 for line in lines[1:-1])
