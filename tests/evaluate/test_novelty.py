import json
import math

import pyro
import pytest
import torch

from bayesncl_pyro import BayesNCLHead, load_run
from bayesncl_pyro.cli import novelty as novelty_cli
from bayesncl_pyro.cli import run_svi
from bayesncl_pyro.data.compositional import (
    NOVEL_KINDS,
    SHAPES,
    load_compositional,
    novel_sets,
    parse_cells,
)
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate import novelty, novelty_detection, novelty_scores
from bayesncl_pyro.infer.estimators import GATES

HOLDOUT = "disk:sky,ring:wall"


# --- the novel sets -------------------------------------------------------------------------------------------------


def _shrink(monkeypatch):
    from bayesncl_pyro.data import compositional

    monkeypatch.setattr(compositional, "NOVEL_SET_SIZE", 64)
    monkeypatch.setitem(compositional.COMPOSITIONAL_SIZES, "train", 12)
    monkeypatch.setitem(compositional.COMPOSITIONAL_SIZES, "test", 4)


@pytest.fixture
def small(monkeypatch):
    """The benchmark's generator at a tenth of its sizes (its draws in the same order)."""
    _shrink(monkeypatch)


def test_novel_sets_are_deterministic_and_unlike_training(small):
    a, b = novel_sets(3, size=16), novel_sets(3, size=16)
    assert set(a) == {"new-shapes", "new-texture", "new-colours"}
    for name in a:
        assert len(a[name]) == 64
        assert torch.equal(a[name].images, b[name].images)
    assert set(a["new-shapes"].labels) == {-1}  # no class of the training set
    assert set(a["new-texture"].labels) == set(range(len(SHAPES)))  # seen shapes
    assert not torch.equal(novel_sets(4, size=16)["new-shapes"].images, a["new-shapes"].images)


def test_holdout_cells_leave_the_rest_of_the_benchmark_as_it_was(small):
    full, held = load_compositional(0, size=16), load_compositional(0, size=16, holdout=parse_cells(HOLDOUT))
    cells = {(0, 0), (3, 3)}
    for split_full, split_held in ((full.train, held.train), (full.test, held.test)):
        pairs = list(zip(split_full.factors["class"].tolist(), split_full.factors["background"].tolist()))
        keep = torch.tensor([p not in cells for p in pairs])
        assert torch.equal(split_full.images[keep], split_held.images)
    unseen = held.novel()["unseen-combinations"]
    assert len(unseen) == len(full.test) - len(held.test) > 0
    assert set(zip(unseen.factors["class"].tolist(), unseen.factors["background"].tolist())) == cells
    assert "unseen-combinations" not in full.novel()


@pytest.mark.parametrize("text, words", [("disk:moon", "shape:background"), ("blob:sky", "shape:background"),
                                         ("disk:sky,disk:grass,disk:sand,disk:wall", "every background of 'disk'")])
def test_bad_holdout_cells_are_refused_in_one_line(text, words):
    with pytest.raises(UserError, match=words):
        parse_cells(text)


def test_holdout_cells_are_refused_for_data_without_cells():
    from bayesncl_pyro.data import load_dataset

    with pytest.raises(UserError, match="compositional benchmark"):
        load_dataset("digits", holdout="disk:sky")


# --- the scores -----------------------------------------------------------------------------------------------------


def test_mutual_information_is_zero_for_identical_draws_and_positive_when_they_disagree():
    same = torch.full((8, 3, 4), 0.3)
    assert torch.allclose(novelty_scores.mutual_information(same), torch.zeros(3), atol=1e-6)
    split = torch.cat([torch.full((4, 3, 4), 0.01), torch.full((4, 3, 4), 0.99)])
    # half the draws say "off", half "on": H(0.5) - H(0.01) per gate
    expected = 4 * (math.log(2) - float(novelty_scores.binary_entropy(torch.tensor(0.01))))
    assert torch.allclose(novelty_scores.mutual_information(split), torch.full((3,), expected), atol=1e-5)


def test_topk_margin_and_mask_follow_each_rows_k():
    x = torch.tensor([[0.9, 0.1, 0.5, 0.45], [0.2, 0.8, 0.7, 0.1]])
    k = torch.tensor([2, 1])
    assert novelty_scores.topk_mask(x, k).tolist() == [[1, 0, 1, 0], [0, 1, 0, 0]]
    assert torch.allclose(novelty_scores.topk_margin(x, k), torch.tensor([-0.05, -0.1]))


def test_atypicality_is_lowest_for_a_set_its_class_uses():
    active = torch.tensor([[1.0, 1, 0, 0]] * 20 + [[0.0, 0, 1, 1]] * 20)
    labels = torch.tensor([0] * 20 + [1] * 20)
    freq = novelty_scores.active_set_frequencies(active, labels, 2)
    typical, odd = novelty_scores.atypicality(torch.tensor([[1.0, 1, 0, 0], [1.0, 0, 1, 0]]), freq)
    assert typical < odd


def test_detection_of_a_separated_and_an_identical_set():
    g = torch.Generator().manual_seed(0)
    known = {"s": torch.randn(2000, generator=g)}
    far = novelty_detection.detection(known, {"s": torch.randn(500, generator=g) + 100})["s"]
    assert far["auroc"] == 1.0 and far["fpr95"] == 0.0 and far["flagged"] == 1.0
    same = novelty_detection.detection(known, {"s": torch.randn(2000, generator=g)})["s"]
    assert abs(same["auroc"] - 0.5) < 0.04 and abs(same["flagged"] - 0.05) < 0.02


def test_report_adds_the_full_spectrum_setting():
    g = torch.Generator().manual_seed(1)
    known = {"kl_prior": torch.randn(300, generator=g)}
    novel = {"new-shapes": {"kl_prior": torch.randn(100, generator=g) + 3},
             "new-colours": {"kl_prior": torch.randn(100, generator=g)}}
    out = novelty_detection.report(known, novel, NOVEL_KINDS)
    assert out["sets"]["new-colours"]["kind"] == "nuisance" and out["sets"]["new-shapes"]["n"] == 100
    assert out["full_spectrum"]["semantic"] == ["new-shapes"] and out["full_spectrum"]["nuisance"] == ["new-colours"]
    assert out["full_spectrum"]["scores"]["kl_prior"]["auroc"] > 0.9
    assert set(out["definitions"]) == {"kl_prior"}


def test_every_primary_score_is_declared():
    names = {novelty.PRIMARY["score"], *novelty.PRIMARY["baselines"]}
    assert names <= set(novelty_scores.SCORES)
    assert novelty.PRIMARY["novel_set"] in NOVEL_KINDS and NOVEL_KINDS[novelty.PRIMARY["novel_set"]] == "semantic"


# --- the Bayesian gating head ---------------------------------------------------------------------------------------


def _bayesian_head():
    torch.manual_seed(0)
    return BayesNCLHead(12, proj_dim=6, proj_hidden=10, num_train=50, gate_head="bayesian")


def test_the_bayesian_head_samples_its_weights_in_model_and_guide_and_pays_their_kl():
    head = _bayesian_head()
    weights = [site for site in head.kl_kind if site.startswith("head.net.") and not site.endswith("_unconstrained")]
    assert len(weights) == 4  # two layers' weights and biases
    h = torch.randn(8, 12)
    terms = head.elbo_terms(head.projector(h), h)
    assert all(site in terms.model_trace.nodes for site in weights)  # W ~ p(W) in the model
    assert all(site in terms.guide_trace.nodes for site in weights)  # W ~ q(W) in the guide
    assert all(terms.site_kl[site].abs() > 0 for site in weights)


def test_the_bayesian_heads_q_varies_over_weight_draws_and_its_evaluation_is_at_their_mean():
    head = _bayesian_head()
    h = torch.randn(5, 12)
    assert torch.equal(head.gate_probs(h), head.gate_probs(h))  # deterministic: q at W's posterior mean
    draws = head.guide.weight_probs(h, 6)
    assert draws.shape == (6, 5, 6) and draws.std(0).mean() > 0
    pyro.set_rng_seed(1)
    loss, _ = head(torch.randn(8, 12))
    loss.backward()
    scales = [p for n, p in head.named_parameters() if ".scales." in n]
    assert scales and all(p.grad is not None for p in scales)  # q(W)'s spread is trained


@pytest.mark.parametrize("gate", sorted(GATES))
def test_the_bayesian_head_trains_its_weights_posterior_under_every_gate_estimator(gate):
    """q(W)'s locations and scales get finite gradients, not all zero, under each estimator; and its locations get
    InfoNCE's gradient, not the KL's alone: from the same draws at two lambdas, g = g_nce + lambda g_kl gives g_nce."""
    grads = {}
    for kl_weight in (3e-5, 1e-3):
        torch.manual_seed(0)
        head = BayesNCLHead(12, proj_dim=6, proj_hidden=10, num_train=50, gate_head="bayesian", gate=gate,
                            kl_weight=kl_weight)
        pyro.set_rng_seed(1)
        torch.manual_seed(1)
        loss, _ = head(torch.randn(8, 12))
        loss.backward()
        for kind in (".locs.", ".scales."):
            found = [p.grad for n, p in head.named_parameters() if kind in n]
            assert found and all(g is not None and torch.isfinite(g).all() for g in found), (gate, kind)
            assert any(g.abs().sum() > 0 for g in found), (gate, kind)
            grads[kl_weight, kind] = found
    (small, large) = 3e-5, 1e-3
    nce = [(large * g1 - small * g2) / (large - small) for g1, g2 in zip(grads[small, ".locs."], grads[large, ".locs."],
                                                                        strict=True)]
    assert sum(g.abs().sum() for g in nce) > 1e-3 * sum(g.abs().sum() for g in grads[small, ".locs."]), gate


def test_a_bayesian_head_without_gates_is_refused():
    with pytest.raises(UserError, match="gate_head bayesian"):
        BayesNCLHead(12, proj_dim=6, proj_hidden=10, num_train=50, prior=None, gate_head="bayesian")


# --- a run's scores -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compositional_run(tmp_path_factory):
    """Two steps of a tiny BayesNCL run on the (shrunk) compositional benchmark with two held-out cells, evaluated.

    The benchmark stays shrunk while the module's tests read the run, which loads its data again.
    """
    with pytest.MonkeyPatch.context() as monkeypatch:
        _shrink(monkeypatch)
        out = tmp_path_factory.mktemp("novel") / "run"
        args = ["--dataset", "compositional", "--max-steps", "2", "--epochs", "1", "--warmup-epochs", "0",
                "--batch-size", "64", "--proj-hidden", "32", "--proj-dim", "16", "--workers", "0", "--holdout-cells",
                HOLDOUT, "--out", str(out)]
        assert run_svi.main(args) == 0
        yield out


def test_every_run_on_generated_data_evaluates_its_novelty(compositional_run):
    result = json.loads((compositional_run / "eval.json").read_text())["novelty"]
    assert set(result["sets"]) == {"unseen-combinations", *NOVEL_KINDS}
    scores = result["sets"]["new-shapes"]["scores"]
    assert {*novelty_scores.POSTERIOR_SCORES, "knn_backbone", "mahalanobis_backbone", "topk_atypicality",
            "control_kl0_kl_prior", "control_ensemble_mi"} <= set(scores)
    assert all(0 <= m["auroc"] <= 1 and 0 <= m["fpr95"] <= 1 for m in scores.values())
    assert result["full_spectrum"]["semantic"] == ["unseen-combinations", "new-shapes"]


def test_novelty_script_writes_its_report_and_figure(compositional_run, capsys):
    assert novelty_cli.main([str(compositional_run), "--no-controls"]) == 0
    printed = capsys.readouterr().out
    assert "new-shapes" in printed and "kl_prior" in printed
    written = json.loads((compositional_run / "novelty.json").read_text())
    assert "control_kl0_kl_prior" not in written["sets"]["new-shapes"]["scores"]
    assert (compositional_run / "novelty-roc.png").stat().st_size > 0


def test_trained_run_novelty_gives_each_image_every_score(compositional_run):
    run = load_run(compositional_run)
    images = load_compositional(5).novel()["new-shapes"].images[:7]
    scores = run.novelty(images, controls=False)
    assert {*novelty_scores.POSTERIOR_SCORES, "knn_backbone", "msp_backbone"} <= set(scores)
    assert all(v.shape == (7,) and torch.isfinite(v).all() for v in scores.values())
    with pytest.raises(UserError, match="32 x 32"):
        run.novelty(torch.zeros(2, 3, 40, 40, dtype=torch.uint8), controls=False)
    with pytest.raises(UserError, match="3-channel"):
        run.novelty(torch.zeros(2, 1, 32, 32, dtype=torch.uint8), controls=False)
    with pytest.raises(UserError, match="no images|empty"):
        run.novelty([], controls=False)


def test_a_run_without_gates_gets_the_deterministic_scores_only(ncl_run):
    run = load_run(ncl_run)
    images = torch.randint(0, 255, (4, 1, 8, 8), dtype=torch.uint8)
    scores = run.novelty(images)
    assert "knn_backbone" in scores and "mahalanobis_representation" in scores
    assert not set(scores) & {*novelty_scores.POSTERIOR_SCORES, "control_kl0_kl_prior", "topk_margin"}


def test_novelty_script_asks_for_folders_where_the_data_has_no_novel_sets(ncl_run, capsys):
    assert novelty_cli.main([str(ncl_run)]) == 2
    assert "--novel NAME=FOLDER" in capsys.readouterr().err
    assert novelty_cli.main([str(ncl_run), "--novel", "justaname"]) == 2
    assert "NAME=FOLDER" in capsys.readouterr().err



def _run(name, seed, primary_auroc, baseline_auroc):
    scores = {novelty.PRIMARY["score"]: dict(auroc=primary_auroc, fpr95=0.5, aupr=0.5, flagged=0.1),
              **{b: dict(auroc=baseline_auroc, fpr95=0.6, aupr=0.4, flagged=0.1) for b in novelty.PRIMARY["baselines"]}}
    sets = {novelty.PRIMARY["novel_set"]: dict(kind="semantic", n=10, scores=scores),
            "new-colours": dict(kind="nuisance", n=10, scores=scores)}
    return dict(name=name, seed=seed, novelty=dict(sets=sets))


def test_the_declared_comparison_pairs_seeds_and_holds_one_holm_family():
    runs = [_run("bayesncl-ste", s, 0.70 + 0.01 * s, 0.60 + 0.012 * s) for s in range(6)] + [
        dict(name="ncl", seed=0, novelty=dict(sets={}))]
    rows = novelty.paired(runs)
    assert [r["baseline"] for r in rows] == list(novelty.PRIMARY["baselines"])
    first = rows[0]
    assert first["n"] == 6 and abs(first["mean"] - (0.10 - 0.002 * 2.5)) < 1e-9
    # Holm over 5 differences and 5 equivalence tests: the smallest p is multiplied by 10
    smallest = min(min(r["p"] for r in rows), min(r["tost_p"] for r in rows))
    assert min(min(r["holm_p"] for r in rows), min(r["holm_tost_p"] for r in rows)) == pytest.approx(
        min(1.0, 10 * smallest))
    summary = novelty.summary(runs[:6])
    assert summary["bayesncl-ste"]["seeds"] == 6
    mean, sd = summary["bayesncl-ste"]["sets"]["new-shapes"]["scores"]["kl_prior"]["auroc"]
    assert mean == pytest.approx(0.725) and sd > 0
    text = "\n".join(novelty.markdown(summary, rows))
    assert "knn_backbone" in text and "Holm" in text and "[0.10]" in text  # a nuisance set shows its share flagged
