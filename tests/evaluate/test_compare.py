"""compare.py's time budget and the paper's numbers: the planning arithmetic, and the paper's CIFAR-100 command end
to end on CPU (in-process, with fewer timing steps; tests/cli/test_scripts.py runs the script itself), on a generated
CIFAR-100-shaped tree with a small encoder."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bayesncl_pyro.cli import compare
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate import comparison
from bayesncl_pyro.train import budget

# the paper's command (compare.py's docstring), made small enough for a CPU: the encoder and sizes
PAPER_COMMAND = ["--dataset", "cifar100", "--recipe", "reference", "--methods", "ncl,bayesncl-ste"]
SMALL = ["--device", "cpu", "--encoder", "cnn", "--batch-size", "50", "--proj-hidden", "32", "--proj-dim", "16",
         "--workers", "0"]


@pytest.fixture(scope="module")
def cifar100_tree(tmp_path_factory) -> Path:
    """100 classes of 32 px JPEGs, 2 train and 1 test image each, laid out like cifar100-jpeg.tar.gz."""
    root = tmp_path_factory.mktemp("cifar100")
    rng = np.random.default_rng(0)
    for c in range(100):
        for split, n in (("train", 2), ("test", 1)):
            for i in range(n):
                path = root / split / f"class{c:03d}" / f"{i}.JPEG"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(path)
    return root


def test_budget_epochs_fit_the_time_left_and_stop_at_the_cap():
    # 90 % of 100 s, less 10 s of building and evaluation, at 8 s an epoch: 10 epochs
    assert budget.budget_epochs(100, 10, 8, 200, 2) == 10
    assert budget.budget_epochs(10_000, 10, 8, 200, 2) == 200
    with pytest.raises(UserError, match="--budget-minutes 0.5 is too short.*--train-subset"):
        budget.budget_epochs(30, 25, 8, 200, 0.5)


def test_paper_table_puts_the_papers_numbers_beside_ours_each_column_naming_its_protocol():
    summary = {"ncl": {"semantic_consistency": [0.12, 0.0], "linear_probe_top1": [0.5, 0.0]},
               "bayesncl-relaxed": {"semantic_consistency": [0.2, 0.0]}}
    lines = comparison.paper_table("cifar100", summary, "reference").splitlines()
    assert lines[0] == ("| Method | Cons. (ours, reference) | Cons. (paper, reference) | LP@1 (ours, reference) "
                        "| LP@1 (paper, reference) |")
    assert lines[2] == "| ncl | 12.00 | 9.91 | 50.00 | 60.67 |"
    assert lines[3] == "| bayesncl-relaxed | 20.00 |  |  |  |"  # no published numbers for this gate
    assert "| LP@1 (ours, fast) | LP@1 (paper, reference) |" in comparison.paper_table("cifar100", summary, "fast")
    assert "H_s (paper, reference)" in comparison.paper_table("in100", summary, "reference")
    assert comparison.paper_table("digits", summary, "fast") == ""
    # the paper's GS row trained the reference's loss: gs-reference-kl here, not gs
    gs = {m: {"semantic_consistency": [0.2, 0.0]} for m in ("bayesncl-gs", "bayesncl-gs-reference-kl")}
    assert comparison.paper_table("cifar100", gs, "reference").splitlines()[2:] == [
        "| bayesncl-gs | 20.00 |  |  |  |", "| bayesncl-gs-reference-kl | 20.00 | 20.75 |  |  |"]
    assert set(comparison.PAPER) == {"cifar10", "cifar100", "in100"}


@pytest.mark.parametrize("recipe, protocol", [("reference", "reference"), ("cpu", "fast")])
def test_the_recipe_chooses_the_evaluation_protocol(recipe, protocol):
    from bayesncl_pyro.config import Config
    from bayesncl_pyro.train.resolve import resolve

    args = compare.parser().parse_args(["--dataset", "cifar100", "--recipe", recipe])
    shared, notes = compare.shared_config(args, 50_000)
    assert resolve(Config(**shared)).eval_protocol == protocol
    args = compare.parser().parse_args(["--dataset", "cifar100", "--recipe", recipe, "--eval-protocol", "fast"])
    assert resolve(Config(**compare.shared_config(args, 50_000)[0])).eval_protocol == "fast"


@pytest.mark.slow  # times, trains and reruns a budgeted comparison (11 s)
def test_the_papers_command_runs_on_a_budget_and_reruns_from_its_plan(cifar100_tree, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(budget, "TIMING_STEPS", budget.TIMING_SKIP + 3)  # three timed steps: seconds, not a minute
    out = tmp_path / "cmp"
    args = [*PAPER_COMMAND, "--data-dir", str(cifar100_tree), *SMALL, "--budget-minutes", "5", "--epochs", "2",
            "--out", str(out)]
    assert compare.main(args) == 0, capsys.readouterr().err
    capsys.readouterr()
    plan = json.loads((out / "budget.json").read_text())
    assert plan["epochs"] == 2 and plan["max_epochs"] == 2 and plan["steps_per_epoch"] == 4
    assert set(plan["step_s"]) == {"ncl", "bayesncl-ste"} and plan["eval_s"] > 0
    for name in ("ncl", "bayesncl-ste"):
        cfg = json.loads((out / f"{name}-seed0" / "config.json").read_text())
        # the recipe's LARS and 10 of 200 warm-up epochs, scaled to the 2 epochs trained
        assert cfg["epochs"] == 2 and cfg["warmup_epochs"] == pytest.approx(0.1) and cfg["optimizer"] == "lars"
        # evaluated by the paper's protocol, and saying so
        assert cfg["eval_protocol"] == "reference"
        assert json.loads((out / f"{name}-seed0" / "eval.json").read_text())["protocol"] == "reference"
    assert cfg["gate"] == "ste" and cfg["prior_prob"] == 0.8 and cfg["kl_weight"] == 3e-5
    md = (out / "comparison.md").read_text()
    assert "2 epochs (at most 2), the most that fit --budget-minutes 5" in md
    assert "evaluation protocol reference: linear probe on raw backbone features, LARS lr 0.4" in md
    assert ("| Method | Cons. (ours, reference) | Cons. (paper, reference) | LP@1 (ours, reference) "
            "| LP@1 (paper, reference) |") in md
    assert 'docs/METHOD.md, section "Published numbers"' in md
    assert "| 9.91 |" in md and "| 22.02 |" in md
    report = json.loads((out / "comparison.json").read_text())
    assert report["budget"]["epochs"] == 2 and report["paper"]["bayesncl-ste"]["semantic_consistency"] == 22.02
    assert report["protocol"] == "reference"
    assert compare.main(args) == 0  # the same plan, the finished runs reused
    again = capsys.readouterr().out
    assert "reusing the plan" in again and "timing" not in again
    assert again.count("already holds a finished run") == 2


def test_a_budget_too_short_for_one_epoch_is_one_line(cifar100_tree, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(budget, "TIMING_STEPS", budget.TIMING_SKIP + 1)
    assert compare.main([*PAPER_COMMAND, "--data-dir", str(cifar100_tree), *SMALL, "--budget-minutes", "0.01",
                         "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--budget-minutes 0.01 is too short" in err
    assert compare.main([*PAPER_COMMAND, "--budget-minutes", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "error: --budget-minutes must be positive, got -1"


@pytest.mark.slow  # compare over several methods and lambdas: tests/cli/test_scripts.py runs the script by default
def test_the_estimators_experiment_runs_each_gate_per_lambda_and_reuses_its_record(tmp_path, capsys):
    """Several --kl-weight values run each BayesNCL method once per value (NCL once), the table of the objective on
    the test split comes with them, and --record keeps each run's record: a later command with another --out (a
    fresh clone) trains nothing that is recorded, and prints the same numbers."""
    args = ["--dataset", "digits", "--methods", "ncl,bayesncl-ste,bayesncl-leg", "--kl-weight", "3e-5", "0.1",
            "--epochs", "1", "--warmup-epochs", "0", "--batch-size", "64", "--proj-hidden", "32", "--proj-dim", "16",
            "--workers", "0", "--device", "cpu", "--max-steps", "3", "--record", str(tmp_path / "record")]
    assert compare.main([*args, "--out", str(tmp_path / "a")]) == 0, capsys.readouterr().err
    capsys.readouterr()
    names = ["ncl", "bayesncl-ste-lambda3e-05", "bayesncl-ste-lambda0.1", "bayesncl-leg-lambda3e-05",
             "bayesncl-leg-lambda0.1"]
    report = json.loads((tmp_path / "a" / "comparison.json").read_text())
    assert [r["name"] for r in report["runs"]] == names
    assert json.loads((tmp_path / "a" / "bayesncl-leg-lambda0.1-seed0" / "config.json").read_text())["kl_weight"] == 0.1
    assert "kl_weight" not in report["settings"]
    md = (tmp_path / "a" / "comparison.md").read_text()
    assert "| Method | Cons. | Cons. ungated | Gates on | LP@1 | test -ELBO |" in md
    for r in report["runs"]:  # -ELBO = E_q[InfoNCE] + lambda KL, at each run's own lambda
        lam = float(r["name"].rpartition("lambda")[2]) if "lambda" in r["name"] else 0.0
        assert r["test_neg_elbo"] == pytest.approx(r["test_nce"] + lam * r["test_kl"], rel=1e-5)
        assert (r["test_kl"] > 0) == (lam > 0)
    assert sorted(p.name for p in (tmp_path / "record").iterdir()) == sorted(
        [f"{n}-seed0" for n in names] + ["comparison.json", "comparison.md"])
    assert not (tmp_path / "record" / "ncl-seed0" / "checkpoint.pt").exists()
    assert compare.main([*args, "--out", str(tmp_path / "b")]) == 0
    assert capsys.readouterr().out.count(": recorded in") == 5 and not (tmp_path / "b" / "ncl-seed0").exists()
    assert json.loads((tmp_path / "b" / "comparison.json").read_text())["summary"] == report["summary"]


def test_topk_per_k_and_gates_per_density_in_one_table_and_ncl_reused_at_another_prior(tmp_path, capsys):
    """The matched-sparsity experiment: TopK at several k, BayesNCL at a density target, the table and figure."""
    small = ["--dataset", "digits", "--epochs", "1", "--warmup-epochs", "0", "--batch-size", "64", "--proj-hidden",
             "32", "--proj-dim", "16", "--workers", "0", "--device", "cpu", "--max-steps", "3",
             "--record", str(tmp_path / "record")]
    assert compare.main([*small, "--methods", "ncl,ncl+topk,bayesncl-ste", "--topk", "2", "4", "--gate-density", "0.3",
                         "--prior-prob", "0.2", "--out", str(tmp_path / "a")]) == 0, capsys.readouterr().err
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
    assert "| Method | Act. | Sparsity | Dims | Cons. | class dims | bg dims | TopK Cons. at Act. |" in md
    assert (tmp_path / "a" / "matched_sparsity.png").stat().st_size > 0
    capsys.readouterr()
    # the published prior: NCL is the same run
    assert compare.main([*small, "--methods", "ncl", "--out", str(tmp_path / "b")]) == 0
    assert "ncl, seed 0: recorded in" in capsys.readouterr().out


def test_compare_defaults_to_run_svis_dataset_and_takes_lists_either_way(capsys):
    """compare.py defaulted to cifar10 where run_svi.py trains the compositional benchmark; --seeds
    took spaces and --methods commas, each refusing the other's."""
    from bayesncl_pyro.cli import run_svi

    assert compare.parser().parse_args([]).dataset == run_svi.parser().parse_args([]).dataset == "compositional"
    spaced = compare.lists(compare.parser().parse_args(["--seeds", "0", "1", "--methods", "ncl", "bayesncl-ste",
                                                         "--topk", "2", "4", "--kl-weight", "3e-5"]))
    commas = compare.lists(compare.parser().parse_args(["--seeds", "0,1", "--methods", "ncl,bayesncl-ste",
                                                        "--topk", "2,4", "--kl-weight", "3e-5"]))
    for args in (spaced, commas):
        assert (args.seeds, args.methods, args.topk, args.kl_weight) == ([0, 1], ["ncl", "bayesncl-ste"], [2, 4],
                                                                          [3e-5])
    assert compare.main(["--seeds", "0,one"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--seeds takes int values, got 'one'" in err


def test_the_summary_says_which_limit_stopped_training():
    """"training stopped after 20 steps" where the epochs ended the runs at 10."""
    assert compare.steps_note({"max_steps": 20, "epochs": 1, "batch_size": 64}, 640, "digits") == (
        "training ran its 10 steps (1 epoch of 10); --max-steps 20 stopped nothing")
    assert compare.steps_note({"max_steps": 2, "epochs": 1, "batch_size": 64}, 640, "digits").startswith(
        "training stopped after 2 of its 10 steps")
    assert compare.steps_note({"epochs": 1}, 640, "digits") is None


def test_the_runs_planning_lives_in_train_and_its_old_paths_warn():
    """Which runs compare.py trains, their names and their records are train/plan's; evaluate/comparison keeps the
    comparison of finished runs, and its old names of the planning still resolve, warning with the new home."""
    from bayesncl_pyro.train import plan

    made = plan.method_configs(["ncl+topk", "bayesncl-ste"], ["bernoulli", "ibp"], [4, 8], densities=[0.3])
    assert list(made) == ["ncl+topk-k4", "ncl+topk-k8", "bayesncl-ste-d0.3", "bayesncl-ste+ibp-d0.3"]
    for name in ("METHOD_NAMES", "RECORD", "method_configs", "recorded_run", "record", "train_time",
                 "shared_settings"):
        assert name not in vars(comparison), name
        with pytest.warns(DeprecationWarning, match=f"moved to bayesncl_pyro.train.plan.{name}"):
            assert getattr(comparison, name) is getattr(plan, name)
