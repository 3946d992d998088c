"""What compare.py's paired tables say: bounds, equivalence, power and Holm against scipy and known values; the declared
primary family apart from the exploratory rows; TopK with and without NCL on its curve, read three ways; the figure's
parts; and a recorded comparison rebuilt without training."""

import json
import math

import numpy as np
import pytest
from scipy import stats
from scipy.interpolate import PchipInterpolator

from bayesncl_pyro.cli import compare
from bayesncl_pyro.evaluate import design
from bayesncl_pyro.evaluate.comparison_figures import paired_figure
from bayesncl_pyro.evaluate.pairing import BASELINES, paired, paired_table, read_curve, topk_at_rate
from bayesncl_pyro.evaluate.stats import holm, interval, minimum_detectable

D = [0.031, -0.004, 0.012, 0.027, 0.008, -0.011, 0.019]


def test_one_sided_bounds_are_the_90_percent_t_interval_and_the_two_sided_one_is_scipys():
    out = interval(D)
    ninety = stats.t.interval(0.90, len(D) - 1, loc=sum(D) / len(D), scale=stats.sem(D))
    assert (out["bound_low"], out["bound_high"]) == pytest.approx(ninety)
    ci = stats.ttest_1samp(D, 0.0).confidence_interval(0.95)
    assert (out["t_low"], out["t_high"]) == pytest.approx((ci.low, ci.high))


def test_tost_p_is_the_larger_of_scipys_two_one_sided_tests_at_the_margin_given():
    m = 0.02
    for d in (D, [x + 0.015 for x in D], [x / 10 for x in D]):
        expected = max(stats.ttest_1samp(d, -m, alternative="greater").pvalue,
                       stats.ttest_1samp(d, m, alternative="less").pvalue)
        assert interval(d, margin=m)["tost_p"] == pytest.approx(expected)
    assert interval([x / 10 for x in D], margin=m)["tost_p"] < 0.05  # differences within 0.3 points: shown equivalent
    assert interval(D, margin=m)["tost_p"] > 0.05  # a mean of 1.2 points with this spread: not shown within 2
    assert "tost_p" not in interval(D)  # no margin, no equivalence test: there is no default margin


def test_the_margin_is_a_fixed_share_of_the_baselines_mean_and_every_row_uses_it():
    assert design.RELATIVE_MARGIN == 0.045  # fixed before any comparison was read: changing it changes every TOST
    assert design.margin([0.40, 0.46]) == pytest.approx(0.045 * 0.43)
    rows = paired(three_seeds())
    ncl_topn = next(r for r in rows if r["baseline"] == BASELINES["ncl"] and r["metric"] == "semantic_consistency_topn")
    assert ncl_topn["margin"] == pytest.approx(0.045 * 0.20)  # NCL's top-N is 0.20 on every seed
    d = ncl_topn["differences"]
    assert ncl_topn["tost_p"] == pytest.approx(max(stats.ttest_1samp(d, -0.009, alternative="greater").pvalue,
                                                   stats.ttest_1samp(d, 0.009, alternative="less").pvalue))


def test_minimum_detectable_difference_matches_the_published_power_tables():
    # one-sample / paired t, two-sided 5 %, 80 % power: d = 0.9960 at n = 10 (Cohen's tables; R's pwr.t.test)
    assert minimum_detectable(1.0, 10) == pytest.approx(0.9960, abs=5e-4)
    assert minimum_detectable(0.03, 10) == pytest.approx(0.03 * 0.9960, abs=2e-5)  # scales with the sd
    # for many seeds, the normal approximation (z_0.975 + z_0.8) / sqrt(n)
    assert minimum_detectable(1.0, 400) == pytest.approx((1.959964 + 0.841621) / 20, rel=0.01)
    assert minimum_detectable(1.0, 3) > minimum_detectable(1.0, 10)  # three seeds detect only large differences
    assert minimum_detectable(0.0, 5) == 0.0 and math.isnan(minimum_detectable(1.0, 1))
    assert interval(D)["mdd"] == pytest.approx(minimum_detectable(stats.tstd(D), len(D)))


def test_holm_adjusts_a_hand_worked_family():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> monotone: 0.02, 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at one
    assert holm([]) == []


def curve(seed):
    """NCL sparser than TopK 32 (as CIFAR-100's CPU arm): NCL brackets a gated run with TopK 16 on its own."""
    return [dict(name="ncl+topk-k16", family="ncl+topk", seed=seed, activation_rate=0.30, sparsity=0.94,
                 semantic_consistency=0.30, semantic_consistency_topn=0.40),
            dict(name="ncl+topk-k32", family="ncl+topk", seed=seed, activation_rate=0.35, sparsity=0.88,
                 semantic_consistency=0.20, semantic_consistency_topn=0.30),
            dict(name="ncl", family="ncl", seed=seed, activation_rate=0.40, sparsity=0.89,
                 semantic_consistency=0.10, semantic_consistency_topn=0.20)]


def test_topk_is_interpolated_with_and_without_ncl_on_its_curve():
    ste = dict(name="ste", family="bayesncl-ste", seed=0, activation_rate=0.32, sparsity=0.91,
               semantic_consistency=0.25, semantic_consistency_topn=0.35)
    out = next(r for r in topk_at_rate(curve(0) + [ste]) if r["name"] == "ste")
    # with NCL: between NCL (0.89) and TopK 16 (0.94), 2/5 of the way; TopK runs alone: TopK 32 (0.88) to 16, 1/2
    assert out["topk_semantic_consistency_at_sparsity"] == pytest.approx(0.10 + 0.4 * 0.20)
    assert out["topk_semantic_consistency_at_sparsity_without_ncl"] == pytest.approx(0.25)
    # on the activation rate NCL is at the curve's far end: both curves bracket the run between the two TopK runs
    assert out["topk_semantic_consistency_at_rate"] == pytest.approx(
        out["topk_semantic_consistency_at_rate_without_ncl"])
    rows = {(r["baseline"], r["metric"]): r for r in paired(topk_at_rate(curve(0) + [ste]))}
    assert rows[BASELINES["topk"], "semantic_consistency"]["mean"] == pytest.approx(0.25 - 0.18)
    assert rows[BASELINES["topk_without_ncl"], "semantic_consistency"]["mean"] == pytest.approx(0.0)
    assert (BASELINES["topk_rate"], "semantic_consistency") in rows
    assert BASELINES["topk_without_ncl"] == "trained TopK at its sparsity (TopK runs only)"


def three_seeds():
    runs = [r for s in range(3) for r in curve(s)]
    runs += [dict(name="ste", family="bayesncl-ste", seed=s, activation_rate=0.32, sparsity=0.91,
                  semantic_consistency=0.25 + 0.01 * s, semantic_consistency_topn=0.35 - 0.02 * s) for s in range(3)]
    return topk_at_rate(runs)


def test_the_primary_family_holds_its_differences_and_equivalence_tests_and_the_rest_is_exploratory():
    rows = paired(three_seeds())
    primary = [r for r in rows if r["role"] == "primary"]
    # the declared endpoint and comparisons; ste has no post-hoc control here, so two of the three are made
    assert {(r["baseline"], r["metric"]) for r in primary} == {
        (BASELINES["ncl"], "semantic_consistency_topn"), (BASELINES["topk_without_ncl"], "semantic_consistency_topn")}
    adjusted = holm([r["p"] for r in primary] + [r["tost_p"] for r in primary])
    assert [r["p_holm"] for r in primary] == pytest.approx(adjusted[:2])
    assert [r["tost_p_holm"] for r in primary] == pytest.approx(adjusted[2:])
    assert all(r["holm_family"].startswith("primary: ste (4 tests") for r in primary)
    exploratory = [r for r in rows if r["role"] == "exploratory"]
    assert [r["p_holm"] for r in exploratory] == pytest.approx(holm([r["p"] for r in exploratory]))
    assert all("tost_p_holm" not in r and "tost_p" in r for r in exploratory)
    # a primary cell's adjusted p is the same whatever else the file holds: another gated method adds no test to it
    other = [dict(r, name="leg", family="bayesncl-leg") for r in three_seeds() if r["name"] == "ste"]
    again = {(r["method"], r["baseline"], r["metric"]): r for r in paired(three_seeds() + other)}
    for r in primary:
        assert again[r["method"], r["baseline"], r["metric"]]["p_holm"] == pytest.approx(r["p_holm"])
    assert all(r["role"] == "exploratory" for k, r in again.items() if k[0] == "leg")


def test_the_table_gives_each_row_its_margin_bounds_tost_mdd_and_holm_within_its_family():
    rows = paired(three_seeds())
    table = paired_table(rows).splitlines()
    assert table[0].split(" | ")[7:] == ["one-sided 95 % bounds", "margin", "TOST p", "MDD (80 %)", "above / below",
                                         "p (t)", "p (Holm)", "TOST p (Holm)", "TopK read otherwise |"]
    r = next(r for r in rows if r["role"] == "primary")
    line = table[2 + rows.index(r)]
    assert f"| > {100 * r['bound_low']:+.2f}, < {100 * r['bound_high']:+.2f} | {100 * r['margin']:.2f} | " \
           f"{r['tost_p']:.3f} | {100 * r['mdd']:.2f} | {r['above']} / {r['below']} | {r['p']:.3f} | " \
           f"{r['p_holm']:.3f} | {r['tost_p_holm']:.3f} |" in line
    assert design.reading(dict(r, p_holm=0.01, mean=-0.02)) == "below the baseline"
    assert design.reading(dict(r, p_holm=0.5, tost_p_holm=0.01)).startswith("within +/- ")
    assert design.reading(dict(r, p_holm=0.5, tost_p_holm=0.5)).startswith("neither separated")


def test_trained_topk_is_read_three_ways_and_each_reading_is_reported():
    curve = [(0.80, 0.30), (0.90, 0.50), (0.95, 0.52), (0.95, 0.54)]  # concave; two points at 0.95, averaged
    assert read_curve(0.85, curve, "quadratic") == pytest.approx(
        np.polyval(np.polyfit([0.80, 0.90, 0.95], [0.30, 0.50, 0.53], 2), 0.85))
    assert read_curve(0.85, curve, "pchip") == pytest.approx(
        float(PchipInterpolator([0.80, 0.90, 0.95], [0.30, 0.50, 0.53])(0.85)))
    assert read_curve(0.79, curve, "pchip") is None and read_curve(0.96, curve, "quadratic") is None
    assert read_curve(0.85, curve[:2], "quadratic") is None  # three points or none
    assert read_curve(0.85, curve[:2], "pchip") == pytest.approx(0.40)  # two points: the line
    rows = paired(three_seeds())
    topk = next(r for r in rows if r["baseline"] == BASELINES["topk_without_ncl"]
                and r["metric"] == "semantic_consistency_topn")
    assert set(topk["readings"]) == {"pchip"}  # two TopK runs a seed: no quadratic through three
    runs = {r["name"]: r for r in three_seeds() if r["seed"] == 0}
    assert topk["readings"]["pchip"]["mean"] == pytest.approx(
        sum(r["semantic_consistency_topn"] - r["topk_semantic_consistency_topn_at_sparsity_without_ncl_pchip"]
            for r in three_seeds() if r["name"] == "ste") / 3)
    assert "topk_semantic_consistency_topn_at_sparsity_pchip" in runs["ste"]
    assert {"p_holm", "tost_p_holm"} <= topk["readings"]["pchip"].keys()  # the family redone with this reading
    assert "pchip " in paired_table([topk])


def test_the_paired_figure_shows_each_seed_both_intervals_a_legend_and_n():
    rows = paired(three_seeds())
    fig = paired_figure(rows)
    ax = fig.axes[0]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["one seed's difference", "mean over seeds", "95 % CI, Student's t (thick, above)",
                      "95 % CI, bootstrap over seeds (below)"]
    assert all(label.get_text().endswith("(n = 3)") for label in ax.get_yticklabels())
    first = next(r for r in rows if r["metric"] == "semantic_consistency")
    seeds_drawn = [sorted(line.get_xdata()) for line in ax.lines if len(line.get_xdata()) == 3]
    assert sorted(100 * d for d in first["differences"]) in [pytest.approx(x) for x in seeds_drawn]
    # the t interval and the bootstrap one at different heights of the row, so that neither hides the other
    t_line = next(line for line in ax.lines if list(line.get_xdata()) == pytest.approx(
        [100 * first["t_low"], 100 * first["t_high"]]))
    assert t_line.get_ydata()[0] != pytest.approx(len({(r["method"], r["baseline"]) for r in rows}) - 1)


def test_a_recorded_comparison_is_rebuilt_from_its_records_without_data_or_training(tmp_path, capsys):
    runs = three_seeds()
    for r in runs:
        r["folder"] = f"{r['name']}-seed{r['seed']}"
        (tmp_path / r["folder"]).mkdir()
        fields = dict(method="bayesncl", gate="ste") if r["family"].startswith("bayesncl") else dict(
            method="ncl", topk=16 if r["family"] == "ncl+topk" else 0)
        (tmp_path / r["folder"] / "config.json").write_text(json.dumps(fields))  # the run's family is read from it
        figures = {k: v for k, v in r.items() if k in ("activation_rate", "sparsity", "semantic_consistency",
                                                       "semantic_consistency_topn")}
        (tmp_path / r["folder"] / "eval.json").write_text(json.dumps(dict(figures, protocol="fast",
                                                                          linear_probe_top1=0.5)))
    # as an early comparison.json has them: no family
    old = dict(dataset="compositional", seeds=[0, 1, 2], notes=["a note"], settings={"epochs": 15}, budget=None,
               wall_s=60.0, runs=[dict(name=r["name"], seed=r["seed"], folder=r["folder"], train_time_s=1.0)
                                  for r in runs])
    (tmp_path / "comparison-d0.3.json").write_text(json.dumps(old))
    assert compare.main(["--rebuild", str(tmp_path / "comparison-d0.3.json")]) == 0
    new = json.loads((tmp_path / "comparison-d0.3.json").read_text())
    assert new["notes"] == ["a note"] and new["settings"] == {"epochs": 15}
    assert new["paired"] and all("p_holm" in r and "mdd" in r and r["role"] == "exploratory" for r in new["paired"])
    assert new["paired_primary"] and all(r["role"] == "primary" and "tost_p_holm" in r for r in new["paired_primary"])
    assert new["design"]["metric"] == "semantic_consistency_topn"
    written = {p.name for p in tmp_path.iterdir()}
    assert {"comparison-d0.3.md", "paired-d0.3.png"} <= written and "matched_sparsity-d0.3.png" not in written
    md = (tmp_path / "comparison-d0.3.md").read_text()
    assert "TOST p" in md
    # the primary family first and apart, then the exploratory rows
    primary, exploratory = md.split("**The primary comparisons**")[1].split("Exploratory rows")
    assert BASELINES["ncl"] in primary and BASELINES["topk"] not in primary
    assert BASELINES["topk"] in exploratory
    assert compare.main(["--rebuild", str(tmp_path / "nothing.json")]) == 2
    assert "--rebuild takes a comparison's json" in capsys.readouterr().err


def test_a_run_of_another_prior_is_paired_with_the_same_seeds_run_at_the_bernoulli_prior():
    """"Does the form of the prior change what the gates select?": each seed's ibp run minus its bernoulli run of the
    same method and settings; the bernoulli runs themselves get no such row, and a seed without one is left out."""
    runs = [dict(name="bayesncl-ste-d0.3", family="bayesncl-ste", seed=s, semantic_consistency=0.20,
                 semantic_consistency_topn=0.40) for s in (0, 1)]
    runs += [dict(name="bayesncl-ste+logit-normal-d0.3", family="bayesncl-ste+logit-normal", seed=s,
                  semantic_consistency=0.20 + 0.01 * (s + 1), semantic_consistency_topn=0.40) for s in (0, 1, 2)]
    rows = [r for r in paired(runs) if r["baseline"] == BASELINES["bernoulli"]]
    method = "bayesncl-ste+logit-normal-d0.3"
    assert {(r["method"], r["metric"]) for r in rows} == {(method, "semantic_consistency"),
                                                          (method, "semantic_consistency_topn")}
    cons = next(r for r in rows if r["metric"] == "semantic_consistency")
    assert cons["seeds"] == [0, 1] and cons["differences"] == pytest.approx([0.01, 0.02])


def test_the_priors_question_is_declared_one_family_of_every_prior_at_a_setting():
    """Each other prior's run minus the bernoulli prior's on the top-N consistency is primary; every prior of one
    setting (D 0.3) is one Holm family of differences and equivalence tests together, and a prior at another setting
    (D 0.5) is a family of its own; the paper's consistency against the bernoulli prior stays exploratory."""
    runs = []
    for setting, shift in (("-d0.3", 0.0), ("-d0.5", 0.05)):
        runs += [dict(name=f"bayesncl-ste{setting}", family="bayesncl-ste", seed=s, semantic_consistency=0.2,
                      semantic_consistency_topn=0.40 + shift) for s in range(4)]
        for i, prior in enumerate(("ibp", "per-image", "logit-normal")):
            runs += [dict(name=f"bayesncl-ste+{prior}{setting}", family=f"bayesncl-ste+{prior}", seed=s,
                          semantic_consistency=0.2, semantic_consistency_topn=0.40 + shift + 0.01 * i + 0.003 * s * s)
                     for s in range(4)]
    rows = [r for r in paired(runs) if r["baseline"] == BASELINES["bernoulli"]]
    primary = [r for r in rows if r["role"] == "primary"]
    assert {r["metric"] for r in primary} == {"semantic_consistency_topn"} and len(primary) == 6
    assert all(r["role"] == "exploratory" for r in rows if r["metric"] == "semantic_consistency")
    for setting in ("-d0.3", "-d0.5"):
        family = [r for r in primary if r["method"].endswith(setting)]
        assert len(family) == 3 and len({r["holm_family"] for r in family}) == 1
        assert family[0]["holm_family"].startswith(f"primary: the prior's form, bayesncl-ste{setting}")
        adjusted = holm([r["p"] for r in family] + [r["tost_p"] for r in family])
        assert [r["p_holm"] for r in family] == pytest.approx(adjusted[:3])
        assert [r["tost_p_holm"] for r in family] == pytest.approx(adjusted[3:])


def test_the_pairings_old_paths_still_work_and_name_the_new_home():
    from bayesncl_pyro.evaluate import comparison, matched

    with pytest.warns(DeprecationWarning, match="bayesncl_pyro.evaluate.pairing.paired"):
        assert matched.paired is paired
    with pytest.warns(DeprecationWarning, match="comparison_figures.paired_figure"):
        assert matched.paired_figure is paired_figure
    with pytest.warns(DeprecationWarning, match="stats.mean_sd"):
        assert comparison.mean_std([1.0, 3.0]) == pytest.approx((2.0, math.sqrt(2)))
