"""compare.py's matched-sparsity experiment: TopK at several k, BayesNCL at a density target, the table and figure."""

import json

from test_compare import run


def test_topk_per_k_and_gates_per_density_in_one_table_and_ncl_reused_at_another_prior(tmp_path):
    small = ["--dataset", "digits", "--epochs", "1", "--warmup-epochs", "0", "--batch-size", "64", "--proj-hidden",
             "32", "--proj-dim", "16", "--workers", "0", "--device", "cpu", "--record", str(tmp_path / "record")]
    first = run(*small, "--methods", "ncl,ncl+topk,bayesncl-ste", "--topk", "2", "4", "--gate-density", "0.3",
                "--prior-prob", "0.2", "--out", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    report = json.loads((tmp_path / "a" / "comparison.json").read_text())
    assert [r["name"] for r in report["runs"]] == ["ncl", "ncl+topk-k2", "ncl+topk-k4", "bayesncl-ste-d0.3"]
    ste = report["runs"][-1]
    config = json.loads((tmp_path / "a" / "bayesncl-ste-d0.3-seed0" / "config.json").read_text())
    assert config["gate_density"] == 0.3 and config["prior_prob"] == 0.2
    assert json.loads((tmp_path / "a" / "ncl-seed0" / "config.json").read_text())["prior_prob"] == 0.8
    assert report["settings"]["prior_prob"] == 0.2  # the gates' shared settings
    assert "semantic_consistency_random_mask" in ste and "semantic_consistency_q_draws" in ste
    assert "_posterior_mean" in ste["representations"]
    md = (tmp_path / "a" / "comparison.md").read_text()
    assert "| Method | Act. | Cons. | class dims | bg dims | TopK Cons. at Act. |" in md
    assert (tmp_path / "a" / "matched_sparsity.png").stat().st_size > 0
    again = run(*small, "--methods", "ncl", "--out", str(tmp_path / "b"))  # the published prior: NCL is the same run
    assert again.returncode == 0, again.stderr
    assert "ncl, seed 0: recorded in" in again.stdout
