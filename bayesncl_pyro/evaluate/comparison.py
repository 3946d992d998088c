"""Several methods' runs side by side (experiments/compare.py).

The finished runs' figures and their pairing by seed in comparison.json, rebuilt from a record's runs by today's code;
their means over seeds in tables, the paper's published numbers beside ours, and comparison.md. Which runs to train
and what their records keep is ``train/plan.py``'s.
"""

import hashlib
import io
from pathlib import Path

from bayesncl_pyro import rundir
from bayesncl_pyro._deprecated import moved
from bayesncl_pyro.errors import UserError, quoted
from bayesncl_pyro.evaluate import design, keys, novelty
from bayesncl_pyro.evaluate.comparison_figures import consistency_figure, matched_figure, paired_figure, png, pyplot
from bayesncl_pyro.evaluate.heldout import describe_protocol
from bayesncl_pyro.evaluate.pairing import (
    BASELINES,
    LABELS,
    MECHANISM,
    MECHANISM_BASELINES,
    READINGS,
    family,
    flat_controls,
    paired,
    paired_table,
    topk_at_rate,
)
from bayesncl_pyro.evaluate.stats import POWER, mean_sd

_CONS, _TOPN, _HS, _LP = "semantic_consistency", "semantic_consistency_topn", "semantic_entropy", "linear_probe_top1"
_CLASS, _BG = "dims_tracking_class", "dims_tracking_background"
_U, _MEAN, _DRAWS, _RANDOM = keys.UNGATED, keys.POSTERIOR_MEAN, keys.Q_DRAWS, keys.RANDOM_MASK
_key, _topk = keys.format, keys.topk  # every column's eval key is keys'

# (column, eval key, scale, format): fractions are shown in percent as in the paper's tables
COLUMNS = [("Cons.", _CONS, 100, ".2f"), ("H_s", _HS, 1, ".3f"),
           ("Act.", "activation_rate", 100, ".2f"), ("LP@1", _LP, 100, ".2f"),
           ("LP@5", "linear_probe_top5", 100, ".2f"), ("kNN", "knn_top1", 100, ".2f"),
           ("P@1", "retrieval_p@1", 100, ".2f"), ("P@3", "retrieval_p@3", 100, ".2f"),
           ("P@5", "retrieval_p@5", 100, ".2f"), ("P@10", "retrieval_p@10", 100, ".2f"),
           ("Sparsity", "sparsity", 100, ".2f"), ("Eff. rank", "effective_rank", 1, ".3f"),
           ("Dims", "active_dims", 1, ".0f"), ("Gates on", "gates_open", 100, ".1f"),
           ("Train s", "train_time_s", 1, ".0f")]
_COLUMN = {c[1]: c for c in COLUMNS}
# the gate estimators' experiment: what the gates add, and the objective itself on the test split (eval.json's
# test_* keys: -ELBO from draws of q, whatever the estimator trained with)
OBJECTIVE_COLUMNS = [_COLUMN[_CONS], ("Cons. ungated", _key(_CONS, _U), 100, ".2f"),
                     _COLUMN["gates_open"], _COLUMN[_LP],
                     ("test -ELBO", "test_neg_elbo", 1, ".4f"), ("E_q InfoNCE", "test_nce", 1, ".4f"),
                     ("InfoNCE at F", "test_nce_mode", 1, ".4f"), ("KL per row", "test_kl", 1, ".3f")]
FACTOR_COLUMNS = [("bg dims (F)", _BG, 1, ".1f"),
                  ("class dims (F)", _CLASS, 1, ".1f"),
                  ("bg dims (ungated)", _key(_BG, _U), 1, ".1f"),
                  ("bg dims gated off %", "gated_off_share_background", 100, ".1f"),
                  ("class dims gated off %", "gated_off_share_class", 100, ".1f")]
# what the gates select and do, against the known factors (eval.json's controls.mask_jaccard*, dci_*, conflict_*)
MECHANISM_COLUMNS = [("Sparsity", "sparsity", 100, ".1f"),
                     ("Jaccard gates / post-hoc TopK", "control_mask_jaccard", 1, ".3f"),
                     ("Jaccard gates / random", "control_mask_jaccard_random", 1, ".3f"),
                     ("DCI D", "dci_disentanglement", 1, ".3f"), ("DCI C", "dci_completeness", 1, ".3f"),
                     ("DCI I class", "dci_informativeness_class", 100, ".1f"),
                     ("DCI I bg", "dci_informativeness_background", 100, ".1f"),
                     ("conflict bg", "conflict_background", 1, ".3f"), ("bg dims measured", "conflict_dims_background",
                                                                       1, ".1f"),
                     ("conflict class", "conflict_class", 1, ".3f"), ("class dims measured", "conflict_dims_class",
                                                                      1, ".1f")]

MATCHED_COLUMNS = [("Act.", "activation_rate", 100, ".1f"), ("Sparsity", "sparsity", 100, ".1f"),
                   ("Dims", "active_dims", 1, ".0f"), ("Cons.", _CONS, 100, ".2f"),
                   ("class dims", _CLASS, 1, ".1f"), ("bg dims", _BG, 1, ".1f"),
                   ("TopK Cons. at Act.", _topk(_CONS, "rate"), 100, ".2f"),
                   ("TopK class dims at Act.", _topk(_CLASS, "rate"), 1, ".1f"),
                   ("TopK Cons. at Sparsity", _topk(_CONS, "sparsity"), 100, ".2f"),
                   ("TopK Cons. at Sparsity (TopK runs only)", _topk(_CONS, "sparsity", without_ncl=True), 100, ".2f"),
                   ("TopK class dims at Sparsity", _topk(_CLASS, "sparsity"), 1, ".1f"),
                   ("random-mask Cons.", _key(_CONS, _RANDOM), 100, ".2f"),
                   ("random-mask class dims", _key(_CLASS, _RANDOM), 1, ".1f"),
                   ("post. mean Cons.", _key(_CONS, _MEAN), 100, ".2f"),
                   ("post. mean Act.", _key("activation_rate", _MEAN), 100, ".1f"),
                   ("q draws Cons.", _key(_CONS, _DRAWS), 100, ".2f"),
                   ("q draws class dims", _key(_CLASS, _DRAWS), 1, ".1f"),
                   ("Gates on", "gates_open", 100, ".1f"), ("LP@1", _LP, 100, ".2f"),
                   ("TopK LP@1 at Act.", _topk(_LP, "rate"), 100, ".2f"),
                   ("TopK LP@1 at Sparsity", _topk(_LP, "sparsity"), 100, ".2f")]
"""compare.py's table at matched sparsity: each run's figures beside the baselines at its own sparsity."""

TOPN_COLUMNS = [("Sparsity", "sparsity", 100, ".1f"), ("Cons. (paper's)", _CONS, 100, ".2f"),
                ("Cons. top-N", _TOPN, 100, ".2f"),
                ("top-N dims", "topn_coverage_dims", 1, ".1f"), ("top-N images", "topn_coverage_images", 100, ".1f"),
                ("chance", "topn_chance", 100, ".2f"),
                ("TopK top-N at Sparsity", _topk(_TOPN, "sparsity"), 100, ".2f"),
                ("TopK top-N at Sparsity (TopK runs only)", _topk(_TOPN, "sparsity", without_ncl=True), 100, ".2f"),
                *((f"{short}: {label}", f"control_{name}_{key}", 100, ".2f")
                  for name, short in (("posthoc_topk", "post-hoc TopK"), ("random_per_image", "random per image"),
                                      ("random_pruned", "random pruned"))
                  for label, key in (("Cons.", _CONS), ("top-N", _TOPN))),
                ("ungated top-N", _key(_TOPN, _U), 100, ".2f"),
                ("q's mean top-N", _key(_TOPN, _MEAN), 100, ".2f"),
                ("q draws top-N", _key(_TOPN, _DRAWS), 100, ".2f")]
"""compare.py's table of the two consistencies: each run's, beside its controls as sparse as F image by image
(eval.json's ``controls``, flattened to ``control_<name>_<key>`` by :func:`flat_controls`)."""

# The paper's numbers (docs/METHOD.md, "Published numbers": ResNet-18, 200 epochs on CIFAR, 100 on ImageNet-100,
# the reference's evaluation protocol), in the units of COLUMNS: dataset -> method -> eval key -> value. The paper's
# "BayesNCL (GS)" trained the reference's loss, which is gs-reference-kl here (gs takes the KL at q's own probability)
_GS = "bayesncl-gs-reference-kl"
PAPER = {
    "cifar10": {"cl": {_CONS: 10.00, _LP: 87.88}, "ncl": {_CONS: 53.82, _LP: 87.80}, "ncl+topk": {_CONS: 51.81},
                _GS: {_CONS: 53.68}, "bayesncl-ste": {_CONS: 56.50, _LP: 88.02}},
    "cifar100": {"cl": {_CONS: 1.00, _LP: 59.72}, "ncl": {_CONS: 9.91, _LP: 60.67}, "ncl+topk": {_CONS: 12.32},
                 _GS: {_CONS: 20.75}, "bayesncl-ste": {_CONS: 22.02, _LP: 60.69}},
    "in100": {"cl": {_CONS: 1.00, _HS: 4.59, _LP: 68.31}, "ncl": {_CONS: 14.93, _HS: 3.28, _LP: 69.63},
              "ncl+topk": {_CONS: 14.27, _HS: 3.35}, _GS: {_CONS: 11.66, _HS: 3.36},
              "bayesncl-ste": {_CONS: 36.14, _HS: 2.10, _LP: 70.44}},
}
METHOD_DOC = 'docs/METHOD.md, section "Published numbers"'  # in the repository; comparison.md points there

def summarise(runs: list[dict], names: list[str]) -> dict:
    """Method -> {key: [mean, std]} over its seeds, for the keys of ``names`` its runs have."""
    out = {}
    for run in runs:
        out.setdefault(run["name"], [])
        out[run["name"]].append(run)
    return {name: {k: list(mean_sd([r[k] for r in rs])) for k in names if all(k in r for r in rs)}
            for name, rs in out.items()}


def comparison(dataset: str, seeds: list[int], notes: list[str], runs: list[dict], settings: dict,
               budget: dict | None, wall_s: float) -> dict:
    """What comparison.json holds: the runs, the means over seeds, the paired comparisons and the shared settings.

    Each run (``runs``: its name, family, seed, folder and eval.json's figures, each given NCL+TopK's at its sparsity),
    each method's means over ``seeds``, the design declared before the runs (``design``: ``design.declaration``), the
    paired rows on the consistencies split by it into the primary family (``paired_primary``) and the exploratory rows
    (``paired``), and, where the runs have them, the rows on :data:`pairing.MECHANISM` (``paired_mechanism``:
    exploratory, another table, another family for Holm), the novelty scores' means (``novelty``) and the declared
    novelty comparisons (``paired_novelty``: ``novelty.paired``), and ``settings`` (``plan.shared_settings``).
    """
    runs = [dict(r, **flat_controls(r)) for r in topk_at_rate(runs)]
    shown = list(dict.fromkeys(c[1] for c in COLUMNS + OBJECTIVE_COLUMNS + FACTOR_COLUMNS + MATCHED_COLUMNS
                               + TOPN_COLUMNS + MECHANISM_COLUMNS))
    protocol = ", ".join(sorted({r["protocol"] for r in runs}))  # one: it is a shared setting
    rows = paired(runs)
    return dict(dataset=dataset, seeds=seeds, protocol=protocol, notes=notes, settings=settings,
                summary=summarise(runs, shown), design=design.declaration(),
                paired_primary=sorted((r for r in rows if r["role"] == "primary"),  # in the declared order
                                      key=lambda r: [BASELINES[b] for b in (*design.PRIMARY_BASELINES,
                                                                            design.PRIOR_BASELINE)].index(r["baseline"])),
                paired=[r for r in rows if r["role"] == "exploratory"],
                paired_mechanism=paired(runs, MECHANISM, MECHANISM_BASELINES),
                novelty=novelty.summary(runs), paired_novelty=novelty.paired(runs), runs=runs,
                paper=PAPER.get(dataset, {}), budget=budget, wall_s=wall_s)


MAX_RUNS = 1_000  # the most runs a comparison's json names: ten times the largest recorded comparison's


def rebuild(path: Path) -> dict:
    """A comparison.json rebuilt from its runs' records, by today's code: no run is trained again.

    ``path``: a comparison's json (``comparison.json``, or a renamed one such as ``comparison-d0.3.json``) in the folder
    that records its runs (``--record``). Each run's eval.json is read again, once, from ``<folder>/<run folder>`` (so
    that figures added to it since, and every figure derived from it, come in), its family from its config.json
    (:func:`matched.family`: comparisons recorded before families have none); its name, seed, folder and training time
    are the comparison's; notes, settings, budget and wall time are kept as they were. A run folder is a folder of the
    record's own, named once, never a path out of it (``..``, an absolute one) nor a link; at most ``MAX_RUNS``.
    """
    old = rundir.read_json(path)
    entries = old.get("runs") if isinstance(old, dict) else None
    if not isinstance(entries, list) or not all(isinstance(r, dict) for r in entries):
        raise UserError(f"{path} is not a comparison's json (no list of runs); pass the comparison.json of a --record "
                        "folder")
    if len(entries) > MAX_RUNS:
        raise UserError(f"{path} names {len(entries):,} runs, more than the {MAX_RUNS:,} a comparison holds; it is not "
                        "what compare.py writes: move it away")
    runs, seen = [], set()
    try:
        for r in entries:
            name = r["folder"]
            if not isinstance(name, str) or name in ("", ".", "..") or "\0" in name or Path(name).name != name:
                raise UserError(f"{path} names the run folder {quoted(name)}, which is not a folder of the record "
                                f"(a name in {path.parent}, as --record writes it); it is not what compare.py writes: "
                                "move it away")
            if name in seen:
                raise UserError(f"{path} names the run folder {quoted(name)} twice; it is not what compare.py writes: "
                                "move it away")
            seen.add(name)
            folder = rundir.inner_folder(path.parent / name)  # a link in the record may point anywhere
            with rundir.RunFolder.open(folder) as kept:  # its config and evaluation from one folder
                cfg = kept.read_json(rundir.CONFIG)
                runs.append(dict(name=r["name"], family=family(cfg), seed=r["seed"], folder=name,
                                 **kept.read_eval(cfg.get("gate")), train_time_s=r["train_time_s"]))
        kept = old["dataset"], old["seeds"], old["notes"], old["settings"], old.get("budget"), old["wall_s"]
    except (KeyError, TypeError) as e:
        raise UserError(f"{path} is not a comparison's json as compare.py writes it ({type(e).__name__}: {e}); pass "
                        "the comparison.json of a --record folder") from None
    dataset, seeds, notes, settings, budget, wall_s = kept
    return comparison(dataset, seeds, notes, runs, settings, budget, wall_s)


def table(summary: dict, columns: list, seeds: int) -> str:
    """The methods' means (with standard deviations over several seeds) as a markdown table."""
    head = ["Method"] + [c[0] for c in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, stats in summary.items():
        cells = [name]
        for _, key, scale, fmt in columns:
            if key not in stats:
                cells.append("")
                continue
            m, s = stats[key]
            cells.append(f"{m * scale:{fmt}}" + (f" ± {s * scale:{fmt}}" if seeds > 1 else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paper_table(dataset: str, summary: dict, protocol: str) -> str:
    """Our means beside the paper's published numbers, as a markdown table.

    Our means are evaluated by ``protocol``, the paper's numbers by the reference's protocol, for the metrics it
    publishes on ``dataset``; "" if none. Each column header names its protocol.
    """
    paper = PAPER.get(dataset, {})
    keys = [c for c in COLUMNS if any(c[1] in numbers for numbers in paper.values())]
    if not keys:
        return ""
    head = ["Method"] + [f"{name} {who}" for name, *_ in keys for who in (f"(ours, {protocol})", "(paper, reference)")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method, stats in summary.items():
        cells = [method]
        for _, key, scale, fmt in keys:
            cells.append(f"{stats[key][0] * scale:{fmt}}" if key in stats else "")
            theirs = paper.get(method, {}).get(key)
            cells.append("" if theirs is None else f"{theirs:{fmt}}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    """comparison.md: the notes, the protocol, then a table of each kind the runs have figures for."""
    dataset, seeds, protocol, summary, runs = (report[k] for k in ("dataset", "seeds", "protocol", "summary", "runs"))
    md = [f"# {dataset}: " + " vs ".join(summary), "",
          *(f"- {n}" for n in report["notes"]),
          "- evaluation protocol " + describe_protocol(protocol, dataset),
          f"- seeds {seeds}" + (" (mean ± std)" if len(seeds) > 1 else "") + "; metrics on the test split, "
          "in percent except H_s (nats), effective rank (nats), Dims and train seconds", "",
          table(summary, COLUMNS, len(seeds))]
    if any("test_neg_elbo" in r for r in runs):
        md += ["", "What the gates add (Cons. of the same model with every gate open) and the objective on the test "
               "split, per row, whatever each run trained: -ELBO = E_q[InfoNCE] + lambda * KL, from 8 draws of "
               "q(g | x) per batch of the training batch size and the exact KL (at each run's own lambda); E_q "
               "InfoNCE, its likelihood term (comparable across runs and lambdas); InfoNCE at F, at the evaluation "
               "mask (the mode).", "", table(summary, OBJECTIVE_COLUMNS, len(seeds))]
    if any(FACTOR_COLUMNS[0][1] in r for r in runs):
        md += ["", "Dimensions by the ground-truth factor they track (bg = background). (F): in the evaluated "
               "representation; ungated: BayesNCL's features before its gates; gated off: share of the dims that "
               "the gates close in most samples where they fire.", "", table(summary, FACTOR_COLUMNS, len(seeds))]
    if any(_topk(_CONS, "rate") in r or _key(_CONS, _RANDOM) in r for r in runs):
        md += ["", f"At matched sparsity ({stem_name('matched_sparsity', report)}): each run's consistency and dims "
               "tracking the class beside NCL+TopK's at the same activation rate of F and at the same sparsity "
               "(linear in it between the two nearest k of the run's own seed, NCL as k = K, or TopK runs only where "
               "the column says so; blank outside their range), the same run's "
               "ungated features under random masks as sparse as F (the mean of 5), and the run judged as a posterior: "
               "at q's mean (soft gating) and over 5 draws from q. LP@1 is on backbone features, one per run.", "",
               table(summary, MATCHED_COLUMNS, len(seeds))]
    if any("semantic_consistency_topn" in r for r in runs):
        n = sorted({r["topn_n"] for r in runs if "topn_n" in r})
        md += ["", f"Two consistencies: the paper's (over every image a dim is active in; it rises as a representation "
               f"gets sparser, whatever it responds to) and the top-N one (each dim's N = {', '.join(map(str, n))} "
               "images of largest value, over the dims active in N images: a class-blind dim scores the chance "
               "level, however sparse), with its coverage (dims judged; images active in one of them). Each gated "
               "run beside its controls, its own ungated features as sparse as F image by image: each image's "
               "largest entries (post-hoc TopK), random entries (the mean of 5), random entries of the dims F uses.",
               "", table(summary, TOPN_COLUMNS, len(seeds))]
    if any(c[1] in r for r in runs for c in MECHANISM_COLUMNS[1:]):
        md += ["", "What the gates select and do, against the known factors. Jaccard: per image, the overlap of the "
               "entries the gates keep with those post-hoc TopK keeps at the same count (1: the same entries), and "
               "with random entries at that count (chance); DCI D and C: disentanglement and completeness of F "
               "against (class, background) (Eastwood and Williams 2018, by disentanglement_lib's gradient-boosted "
               "trees), I: held-out accuracy of each factor's predictor; conflict: the mean cancellation of the "
               "InfoNCE gradient's two parts in training (1: pull and push cancel) over the dims of F that track each "
               "factor and were measured (dims measured).", "", table(summary, MECHANISM_COLUMNS, len(seeds))]
    paired_note = (
        "each gated method minus each baseline on the same seed, in points; 95 % confidence intervals of the mean "
        "difference by Student's t and by the bootstrap over seeds (10,000 resamples; a percentile bootstrap of 3 to "
        "10 seeds covers less than 95 %, so it is no check of the t interval); one-sided 95 % bounds: the mean "
        "difference is above the first and below the second, each at 95 % (\"no gain above\" the second); margin and "
        f"TOST p: two one-sided tests of a difference within +/- {100 * design.RELATIVE_MARGIN:g} % of the "
        "baseline's mean over the paired seeds (the margin, in points, fixed in code before any result was read: "
        "evaluate/design.py), below 0.05 only where the difference is shown to be that small; MDD: the true "
        f"difference a two-sided 5 % paired t test of these seeds detects with {100 * POWER:g} % power at their "
        "standard deviation; above / below: seeds whose difference is positive / negative; p: two-sided t test of a "
        "zero mean, and Holm's adjustment within the row's family. An interval that contains 0 does not separate the "
        "method from the baseline, nor show them equal: the bounds and TOST say how large a difference the seeds "
        "leave possible. Trained TopK is interpolated at the gated run's own sparsity (share of zeros over all K dims) "
        "or activation rate (of its live dims), between the two nearest points of its seed's curve, with NCL as a "
        "point of the curve (k = K) and on TopK runs alone: the two differ where NCL is one of the nearest points. "
        "The last column reads the same curve otherwise (" + "; ".join(f"{k}: {v}" for k, v in READINGS.items())
        + "): where it moves a conclusion, the linear reading is not to be trusted alone.")
    d = report.get("design") or design.declaration()
    if report.get("paired_primary"):
        md += ["", f"**The primary comparisons**, declared before the runs (evaluate/design.py): {d['method']} on "
               f"{LABELS[d['metric']]} against " + ", ".join(BASELINES[b] for b in d["baselines"]) + "; one Holm "
               "family per setting of the method over the differences' and the equivalence tests' p values together "
               f"(p (Holm) and TOST p (Holm)); and, for runs at other priors, the question whether the prior's form "
               f"changes what the gates select: each prior's run against {BASELINES[design.PRIOR_BASELINE]}, every "
               f"prior of a setting in one Holm family. The verdict rests on these rows alone; {paired_note}", "",
               paired_table(report["paired_primary"]), "",
               *(f"- {r['method']} minus {r['baseline']}: {design.reading(r)}" for r in report["paired_primary"])]
    if report.get("paired"):
        md += ["", f"Exploratory rows, every other comparison: no verdict rests on them, and p (Holm) is over this "
               f"table's {len([r for r in report['paired'] if 'p' in r])} rows as a guide "
               f"({stem_name('paired', report)}, with the primary rows). "
               + ("The columns are the primary table's." if report.get("paired_primary") else paired_note), "",
               paired_table(report["paired"])]
    if report.get("paired_mechanism"):
        md += ["", f"The same, on what the gates do ({stem_name('paired_mechanism', report)}): DCI and the gradient "
               "conflict, against NCL and trained TopK (values x 100; TOST at the same relative margin); exploratory, "
               "a family of its own for Holm.", "", paired_table(report["paired_mechanism"])]
    if report.get("novelty"):
        md += novelty.markdown(report["novelty"], report.get("paired_novelty", []))
    paper = paper_table(dataset, summary, protocol)
    if paper:
        caveat = "" if protocol == "reference" else (", so our LP@1 is not measured as the paper's is (--eval-protocol "
                                                     "reference, in another --out, measures it so)")
        md += ["", f"Beside the paper's numbers ({METHOD_DOC}: ResNet-18 at the full recipe, 200 epochs on CIFAR, "
               f"100 on ImageNet-100, evaluated by the reference protocol); ours evaluated by the {protocol} "
               f"protocol{caveat}:", "", paper]
    md += ["", "Shared settings: " + ", ".join(f"{k}={v}" for k, v in report["settings"].items()),
           f"Wall time of this command: {report['wall_s'] / 60:.1f} min", ""]
    return "\n".join(md)


def stem_name(stem: str, report: dict) -> str:
    """A file of the comparison by its stem: ``<stem><report's suffix>.png`` (the suffix of a renamed comparison)."""
    return f"{stem}{report.get('suffix', '')}.png"


FIGURES = ("consistency_vs_probe", "matched_sparsity", "paired", "paired_mechanism")
"""The figures of a comparison, by their stem."""


def write_comparison(out: Path, report: dict, suffix: str = "", figures: tuple[str, ...] = FIGURES) -> str:
    """Write comparison<suffix>.json, its ``figures`` and comparison<suffix>.md into ``out``.

    The figures (:data:`FIGURES`), each name ending in ``suffix`` (a folder may hold several comparisons:
    comparison-d0.3.*): consistency_vs_probe, matched_sparsity, paired (where there are gated runs with baselines) and
    paired_mechanism (where they have the mechanism's figures). Returns the markdown's text.

    The files land together (``rundir.save_together``): each is written to a temporary file first, and only when all
    are written are they renamed over the old ones, so a failure midway (a figure that cannot be drawn, a full disk,
    Ctrl-C) leaves the previous comparison whole, never a new comparison.md beside an old comparison.json. The renames
    are one after another (the json first, naming each other file's digest in ``files``): what a SIGKILL between two
    leaves, :func:`mismatched` names.
    """
    # by the rule of rundir, as every writer: into a real folder, by renames that replace a link, never through one
    out = rundir.output_folder(out, named=True)  # created: every run may have come from --record
    report = dict(report, suffix=suffix) if suffix else report
    drawn = {}
    try:
        if "consistency_vs_probe" in figures:
            drawn["consistency_vs_probe"] = consistency_figure(report["runs"])
        if "matched_sparsity" in figures:
            drawn["matched_sparsity"] = matched_figure(report["runs"])
        if "paired" in figures and (rows := report.get("paired_primary", []) + report.get("paired", [])):
            drawn["paired"] = paired_figure(rows)
        if "paired_mechanism" in figures and report.get("paired_mechanism"):
            drawn["paired_mechanism"] = paired_figure(report["paired_mechanism"])
        md = markdown(report)
        files = {stem_name(stem, report): _bytes_of(png(fig)) for stem, fig in drawn.items()}
        files[f"comparison{suffix}.md"] = md.encode()
        # the json first, with the digest of every other file: a kill between two renames leaves a new json beside
        # files it names other bytes for (mismatched), never an old json beside new files
        rundir.save_together([(rundir.json_bytes(dict(report, files={name: _digest(data) for name, data in
                                                                      files.items()})),
                               out / f"comparison{suffix}.json"),
                              *((data, out / name) for name, data in files.items())])
    finally:
        for fig in drawn.values():
            pyplot().close(fig)
    return md


def _bytes_of(write) -> bytes:
    """What ``write`` (a writer into a binary file, ``png(fig)``) writes."""
    buffer = io.BytesIO()
    write(buffer)
    return buffer.getvalue()


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def mismatched(path: Path) -> list[str]:
    """The files beside the comparison's json ``path`` that hold other bytes than the ones written with it.

    ``write_comparison`` renames its files one after another (json first, with the digest of each other file, in
    ``files``); a kill (SIGKILL, a power cut) between two renames leaves the new json beside the files it has not
    renamed yet, which this names. A file that is not there is not named (a ``--record`` folder keeps no run figures;
    a comparison killed in its first write lacks those not renamed yet); a json written before ``files`` names none.
    """
    with rundir.RunFolder.open(path.parent) as folder:  # the json and its files from one folder
        written = folder.read_json(path.name)
        files = written.get("files") if isinstance(written, dict) else None
        out = []
        for name, digest in files.items() if isinstance(files, dict) else ():
            if isinstance(name, str) and Path(name).name == name and folder.exists(name) and \
                    _digest(folder.read_bytes(name, rundir.TEXT_LIMIT)) != digest:
                out.append(name)
    return out


def __getattr__(name: str):
    return moved(__name__, name)  # the figures, the sample sd and the runs' planning moved out (_deprecated)
