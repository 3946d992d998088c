"""Novelty across runs: the question declared before any run, its paired comparison and comparison.md's section.

Does the gate posterior q(g | x) flag images unlike the training data better than deterministic scores? The modules,
in the order the evidence flows: ``novelty_scores`` (every score of one run, a number per image), ``novelty_controls``
(the gating heads fitted on the run's frozen backbone that tell the Bayesian part's share), ``novelty_detection``
(how well each score flags each novel set: eval.json's ``novelty``), then here: which comparison answers the question
(``PRIMARY``), declared before any run, paired by seed (:func:`paired`), the runs' detection figures over seeds
(:func:`summary`) and their section of comparison.md (:func:`markdown`); ``novelty_figures`` draws the ROC curves.
"""

import math

from bayesncl_pyro._deprecated import moved
from bayesncl_pyro.evaluate.stats import mean_sd

PRIMARY = dict(novel_set="new-shapes", metric="auroc", score="kl_prior",
               baselines=("knn_backbone", "mahalanobis_backbone", "msp_backbone", "topk_atypicality",
                          "control_kl0_kl_prior"),
               margin=0.02)
"""The question, declared before the runs: on new shapes (semantic novelty), is the posterior's per-image KL's AUROC
above each deterministic baseline of the same run (kNN and Mahalanobis on h, the probe's max-softmax, TopK's
atypicality) and above the same head trained with no KL? Paired by seed; one Holm family over the five differences and
their five equivalence tests (TOST within +/- ``margin`` of AUROC)."""


def paired(runs: list[dict], primary: dict = PRIMARY) -> list[dict]:
    """The declared comparisons of :data:`PRIMARY`, paired by seed within each gated method's runs.

    ``runs``: eval dicts with ``name`` (the method's), ``seed`` and ``novelty``. For each method, each baseline: the
    primary score's metric minus the baseline's on the primary novel set, one difference a seed (the same run's images
    scored both ways), with ``stats.interval``'s mean, intervals, bounds and TOST at ``primary["margin"]``; then Holm's
    adjustment over the family of every difference's p and every TOST p of that method together (``holm_p``,
    ``holm_tost_p``).
    """
    from bayesncl_pyro.evaluate.stats import holm, interval  # late: scipy, only a comparison needs it

    rows = []
    methods = dict.fromkeys(r["name"] for r in runs if primary["score"] in _scores(r, primary))
    for method in methods:
        mine = [r for r in runs if r["name"] == method and primary["score"] in _scores(r, primary)]
        family = []
        for baseline in primary["baselines"]:
            pairs = [(_scores(r, primary)[primary["score"]], _scores(r, primary).get(baseline)) for r in mine]
            diffs = [a[primary["metric"]] - b[primary["metric"]] for a, b in pairs if b is not None]
            if diffs:
                family.append(dict(method=method, score=primary["score"], baseline=baseline,
                                   novel_set=primary["novel_set"], metric=primary["metric"],
                                   **interval(diffs, margin=primary["margin"])))
        ps = [row.get("p", math.nan) for row in family] + [row.get("tost_p", math.nan) for row in family]
        if family and not any(math.isnan(p) for p in ps):
            adjusted = holm(ps)
            for i, row in enumerate(family):
                row.update(holm_p=adjusted[i], holm_tost_p=adjusted[len(family) + i])
        rows += family
    return rows


def _scores(run: dict, primary: dict) -> dict:
    return run.get("novelty", {}).get("sets", {}).get(primary["novel_set"], {}).get("scores", {})


def summary(runs: list[dict]) -> dict:
    """Per method, per novel set and score: the mean and sd over seeds of AUROC, FPR95 and the share flagged."""
    out = {}
    for method in dict.fromkeys(r["name"] for r in runs if "novelty" in r):
        mine = [r["novelty"] for r in runs if r["name"] == method and "novelty" in r]
        sets = {}
        for name in mine[0]["sets"]:
            scores = {}
            for score in mine[0]["sets"][name]["scores"]:
                values = {m: [n["sets"][name]["scores"][score][m] for n in mine if score in n["sets"].get(name, {}).get(
                    "scores", {})] for m in ("auroc", "fpr95", "flagged")}
                scores[score] = {m: mean_sd(v) for m, v in values.items()}
            sets[name] = dict(kind=mine[0]["sets"][name]["kind"], scores=scores)
        out[method] = dict(seeds=len(mine), sets=sets)
    return out


def markdown(summary_: dict, rows: list[dict]) -> list[str]:
    """comparison.md's novelty section: each method's AUROC per score and set, then the declared paired comparisons."""
    md = []
    for method, s in summary_.items():
        sets = list(s["sets"])
        head = ["score"] + [f"{n} ({s['sets'][n]['kind']})" for n in sets]
        md += ["", f"Novelty, {method} ({s['seeds']} seeds): AUROC against the in-distribution test split, mean ± sd "
               "over seeds (a semantic set is to be flagged: 1 is perfect; a nuisance set changes no class: a score "
               "that follows the class stays near 0.5, and the share it flags at the test split's 95th percentile, "
               "in brackets, near 0.05).", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for score in s["sets"][sets[0]]["scores"]:
            cells = [score]
            for n in sets:
                m = s["sets"][n]["scores"].get(score)
                if m is None:
                    cells.append("")
                    continue
                (a, sd), (f, _) = m["auroc"], m["flagged"]
                cells.append(f"{a:.3f} ± {sd:.3f}" + (f" [{f:.2f}]" if s["sets"][n]["kind"] == "nuisance" else ""))
            md.append("| " + " | ".join(cells) + " |")
    if rows:
        p = rows[0]
        md += ["", f"The declared question (evaluate/novelty.py, PRIMARY): on {p['novel_set']}, the {p['metric']} of "
               f"{p['score']} minus each baseline's, paired by seed; 95 % t interval, one-sided 95 % bounds, TOST "
               f"within ± {PRIMARY['margin']:g}, the minimum detectable difference at 80 % power, and Holm's "
               "adjustment over the differences' and the equivalence tests' p values together.", "",
               "| method | baseline | n | mean | 95 % interval | bounds | TOST p | MDD | p | Holm p | Holm TOST p |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if "t_low" not in r:
                md.append(f"| {r['method']} | {r['baseline']} | {r['n']} | {r['mean']:+.3f} | | | | | | | |")
                continue
            md.append(f"| {r['method']} | {r['baseline']} | {r['n']} | {r['mean']:+.3f} | [{r['t_low']:+.3f}, "
                      f"{r['t_high']:+.3f}] | {r['bound_low']:+.3f}, {r['bound_high']:+.3f} | {r['tost_p']:.3f} | "
                      f"{r['mdd']:.3f} | {r['p']:.3f} | {r.get('holm_p', math.nan):.3f} | "
                      f"{r.get('holm_tost_p', math.nan):.3f} |")
    return md


def __getattr__(name: str):
    return moved(__name__, name)  # the scores, the control heads and one run's detection moved out (_deprecated)
