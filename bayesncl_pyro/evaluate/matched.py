"""Is a gate's gain more than sparsity? The baselines that answer it, and the representations of a gated run.

Semantic consistency rises as a representation gets sparser, whatever selects the entries that stay: a dimension
that fires on fewer images has its top class cover more of them. So a gated run is judged beside

* the same run's ungated features under *random* masks that keep as many active entries as its representation F
  has (:func:`random_mask_null`): the same encoder and the same sparsity, without the gates' selection;
* NCL+TopK of the same seed at the same activation rate or sparsity (:func:`topk_at_rate`, in ``compare.py``'s
  tables): another way to be that sparse, trained as such;

and, since an ELBO-trained q near its prior has a mode that summarises it badly, at the posterior mean (the paper's
"soft gating", normalise(u * p)) and averaged over draws of g ~ q(g | x) (:func:`posterior_representations`).

The random-mask null matches F's sparsity in expectation only and keeps every dim of u alive; the controls of
:func:`count_matched_controls` match it image by image: u keeping each image's largest entries (a TopK chosen after
training), and random entries of the image, among all of u's dims or only those F uses (:data:`CONTROLS`). Every
figure is given on the paper's consistency and on the top-N one (``metrics.topn_consistency``), which sparsity
cannot game.
"""

import itertools
import math

import torch

from bayesncl_pyro.evaluate.metrics import (
    activation_rate,
    active_dims,
    active_entries,
    alive,
    factor_tracking,
    semantic_consistency,
    sparsity,
    topn_consistency,
)
from bayesncl_pyro.evaluate.stats import holm, interval
from bayesncl_pyro.nn.losses import normalize
from bayesncl_pyro.rundir import save_figure

RANDOM_MASKS = 5
"""Seeded random masks the null's figures are averaged over."""
Q_DRAWS = 5
"""Draws of g ~ q(g | x) the ``_q_draws`` figures are averaged over."""

REPRESENTATIONS = {
    "": "F, the evaluated representation: normalise(u * m), m the posterior mode 1[q(g = 1 | x) > 0.5] for "
        "BayesNCL; normalise(relu(z)) (top k kept with --topk) for NCL; normalise(z) for CL",
    "_ungated": "u = normalise(relu(z)), BayesNCL's features with every gate open",
    "_posterior_mean": "normalise(u * p), p = q(g = 1 | x): the posterior mean's soft gating",
    "_q_draws": f"normalise(u * g), g ~ q(g | x): the mean over {Q_DRAWS} seeded draws",
    "_random_mask": f"normalise(u * r), r a random mask keeping each active entry of u with probability "
                    f"random_mask_keep (= F's active entries / u's): the mean over {RANDOM_MASKS} seeded masks",
}
"""What each suffix of eval.json's keys is a figure of (eval.json's ``representations``); the linear probe and kNN
are on backbone features, the same for all."""


def summary(features: torch.Tensor, labels: torch.Tensor, factors: dict | None) -> dict:
    """The figures that change with the representation.

    The paper's consistency and the top-N one with its coverage, activation rate, dims in use and, where the factors are
    known, the dims tracking each.
    """
    out = dict(semantic_consistency=semantic_consistency(features, labels), **topn_consistency(features, labels),
               activation_rate=activation_rate(features), active_dims=active_dims(features))
    if factors is not None:
        out.update({f"dims_tracking_{n}": int(m.sum()) for n, m in factor_tracking(features, factors).items()})
    return out


def _mean(runs: list[dict], suffix: str) -> dict:
    return {k + suffix: sum(r[k] for r in runs) / len(runs) for k in runs[0]}


def random_mask_null(ungated: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, factors: dict | None = None,
                     seed: int = 0) -> dict:
    """The sparsity null of a gated run: its ungated features under random masks.

    The masks keep each active entry with probability ``random_mask_keep`` = (active entries of F) / (active entries of
    u), so that the masked features have F's active entries in expectation, chosen without regard to the image. Masking
    an inactive entry changes nothing, so this is the run's own open rate whenever the gates close active and inactive
    entries alike; where they prefer one kind, the open rate would not keep F's sparsity, and this does.
    :func:`summary`'s figures averaged over :data:`RANDOM_MASKS` seeded masks, keys ending in ``_random_mask``.
    """
    keep = float(active_entries(features).sum() / active_entries(ungated).sum().clamp_min(1))
    g = torch.Generator().manual_seed(seed)
    runs = [summary(normalize(ungated * (torch.rand(ungated.shape, generator=g) < keep)), labels, factors)
            for _ in range(RANDOM_MASKS)]
    return dict(_mean(runs, "_random_mask"), random_mask_keep=keep)


def posterior_representations(ungated: torch.Tensor, probs: torch.Tensor, labels: torch.Tensor,
                              factors: dict | None = None, seed: int = 0) -> dict:
    """A gated run judged as a posterior: at p and at draws from q, not at its mode.

    :func:`summary` of normalise(u * p) (keys ending in ``_posterior_mean``) and the mean of it over :data:`Q_DRAWS`
    seeded draws normalise(u * g), g ~ Bernoulli(p) (``_q_draws``); u: N x K ungated features, p: N x K q(g = 1 | x).
    """
    g = torch.Generator().manual_seed(seed)
    draws = [summary(normalize(ungated * torch.bernoulli(probs, generator=g)), labels, factors)
             for _ in range(Q_DRAWS)]
    return {**_mean([summary(normalize(ungated * probs), labels, factors)], "_posterior_mean"),
            **_mean(draws, "_q_draws")}


CONTROLS = {
    "posthoc_topk": "the run's ungated features u, each image keeping as many of its largest entries as its gates "
                    "kept (F's active entries in that image): TopK chosen after training, per image",
    "random_per_image": f"u, each image keeping exactly F's count of active entries, drawn uniformly among its own "
                        f"active entries: the mean over {RANDOM_MASKS} seeded masks",
    "random_pruned": f"as random_per_image, drawn only among the dims F uses (those alive in F): the mean over "
                     f"{RANDOM_MASKS} seeded masks",
}
"""The controls of a gated run (eval.json's ``controls``): the same encoder's features, as sparse as F image by image,
with the entries chosen by another rule than the gates'."""


def _keep_first(scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """N x K bool: in each row, the ``counts`` (N) entries of smallest score (ties by index)."""
    rank = scores.argsort(dim=1, stable=True).argsort(dim=1)
    return rank < counts[:, None]


def control_masks(ungated: torch.Tensor, features: torch.Tensor, seed: int = 0) -> dict[str, list[torch.Tensor]]:
    """The N x K bool masks of the controls.

    The controls are :data:`CONTROLS`: one for ``posthoc_topk``, :data:`RANDOM_MASKS` seeded ones for each random
    control. ungated: N x K u; features: N x K F = normalise(u * m). Each mask keeps, in every image, F's number of
    active entries, chosen among u's non-zero entries (F's non-zero entries are among them, so the count is always there
    to keep).
    """
    nonzero = ungated != 0
    counts = active_entries(features).sum(dim=1).long()
    out = {"posthoc_topk": [_keep_first(torch.where(nonzero, -ungated.double(), torch.inf), counts)]}
    g = torch.Generator().manual_seed(seed)
    for name, eligible in (("random_per_image", nonzero), ("random_pruned", nonzero & alive(features))):
        out[name] = [_keep_first(torch.where(eligible, torch.rand(ungated.shape, generator=g, dtype=torch.float64),
                                             torch.inf), counts) for _ in range(RANDOM_MASKS)]
    return out


def mask_jaccard(kept: torch.Tensor, other: torch.Tensor) -> float:
    """Per image Jaccard overlap |A & B| / |A | B| of two N x K bool masks, averaged over the images.

    An image where both masks keep nothing has no overlap to measure and is left out; 0.0 if every image is such.
    """
    union = (kept | other).sum(dim=1)
    both = (kept & other).sum(dim=1)
    some = union > 0
    return float((both[some].double() / union[some]).mean()) if some.any() else 0.0


MASK_OVERLAP = {
    "mask_jaccard": "per image Jaccard overlap of the entries the gates keep (F's active entries) and those post-hoc "
                    "TopK keeps at the same count (posthoc_topk's mask), averaged over images",
    "mask_jaccard_random": f"the same overlap of F's active entries with random_per_image's masks (the same count, "
                           f"drawn among u's active entries): what chance gives, the mean over {RANDOM_MASKS} masks",
}
"""The two mask overlaps in eval.json's ``controls``: whether the gates choose the entries a TopK of the same
features chooses, against chance."""


def count_matched_controls(ungated: torch.Tensor, features: torch.Tensor, labels: torch.Tensor,
                           factors: dict | None = None, seed: int = 0) -> dict:
    """The controls that separate the gates' selection from what training did to the encoder.

    Returns ``{name: figures}``, :func:`summary`'s and the sparsity of normalise(u * mask), averaged over each control's
    :func:`control_masks`, and the overlaps of :data:`MASK_OVERLAP` (floats) of those same masks with F's.
    ungated: N x K u, features: N x K F, labels: N.
    """
    def figures(mask):
        x = normalize(ungated * mask)
        return dict(summary(x, labels, factors), sparsity=sparsity(x))

    masks = control_masks(ungated, features, seed)
    kept = active_entries(features).bool()
    out = {name: _mean([figures(m) for m in ms], "") for name, ms in masks.items()}
    return dict(out, mask_jaccard=mask_jaccard(kept, masks["posthoc_topk"][0]),
                mask_jaccard_random=sum(mask_jaccard(kept, m) for m in masks["random_per_image"]) / RANDOM_MASKS)


def interpolate(x: float, points: list[tuple[float, float]]) -> float | None:
    """Y at x, linear between the two nearest points (x_i, y_i) that bracket x; None outside their range."""
    points = sorted(points)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if points and x == points[0][0]:
        return points[0][1]
    return None


MECHANISM = {"dci_disentanglement": "DCI disentanglement", "dci_completeness": "DCI completeness",
             "conflict_background": "conflict on background dims", "conflict_class": "conflict on class dims"}
"""What the gates do to the representation and to training, against the known factors: DCI (``dci.dci``) and the
gradient conflict on the dims tracking each factor (``diagnostics.conflict_by_factor``), paired by seed as
:data:`METRICS` are but against NCL and trained TopK only (the controls have no training and no such figures)."""

TOPK_KEYS = ("semantic_consistency", "semantic_consistency_topn", "dims_tracking_class", "linear_probe_top1",
             *MECHANISM)


MATCH_ON = {"rate": "activation_rate", "sparsity": "sparsity"}
"""The two measures of sparsity a run is matched on: the activation rate (the reference's: the share of active
entries among the dims in use, so a representation that closes whole dims can be sparse and still have a high rate)
and the share of zero entries over all K dims (what a TopK's k fixes, and what the random-mask null keeps)."""


WITHOUT_NCL = "_without_ncl"
"""Suffix of the TopK figures interpolated on TopK runs alone (:func:`topk_at_rate`)."""


def topk_at_rate(runs: list[dict]) -> list[dict]:
    """Give each run NCL+TopK's figures at its own activation rate and sparsity, with and without NCL on the curve.

    ``runs`` (compare.py's: dicts with ``name``, ``family``, ``seed`` and their eval figures), each given the NCL+TopK
    curve of its own seed at its own activation rate and at its own sparsity: ``topk_<key>_at_rate`` and
    ``topk_<key>_at_sparsity`` for the keys in TOPK_KEYS, interpolated linearly in that measure between the two nearest
    settings of that seed with NCL as a point of the curve (TopK with every dim kept), and the same keys ending in
    :data:`WITHOUT_NCL` between the two nearest TopK runs alone. The two differ where NCL is one of the two nearest
    points: NCL is sparser than a large k on some data (CIFAR-100's CPU arm: NCL 89 % zeros, TopK 32 88 %), and then
    brackets a gated run with a TopK run. Each is left out where the run lies outside its curve's range. A seed's curve
    is never averaged with another's: the seed draws the data too (the generated benchmark's test split). Runs of the
    curve itself get nothing.
    """
    curves = {}
    for r in runs:
        if r["family"] in ("ncl+topk", "ncl"):
            curves.setdefault(r.get("seed"), []).append(r)
    out = []
    for r in runs:
        r = dict(r)
        with_ncl = curves.get(r.get("seed"), [])
        if r["family"] not in ("ncl+topk", "ncl"):
            for ending, curve in (("", with_ncl), (WITHOUT_NCL, [c for c in with_ncl if c["family"] == "ncl+topk"])):
                if len(curve) < 2:
                    continue
                for (suffix, x), key in itertools.product(MATCH_ON.items(), TOPK_KEYS):
                    value = interpolate(r[x], [(c[x], c[key]) for c in curve if key in c])
                    if value is not None:
                        r[f"topk_{key}_at_{suffix}{ending}"] = value
        out.append(r)
    return out


METRICS = {"semantic_consistency": "the paper's consistency", "semantic_consistency_topn": "top-N consistency"}
"""The two consistencies every paired comparison is made on."""

TOPK_BASELINES = {
    "topk": ("sparsity", "", "trained TopK at its sparsity (NCL on the curve)"),
    "topk_without_ncl": ("sparsity", WITHOUT_NCL, "trained TopK at its sparsity (TopK runs only)"),
    "topk_rate": ("rate", "", "trained TopK at its activation rate (NCL on the curve)"),
    "topk_rate_without_ncl": ("rate", WITHOUT_NCL, "trained TopK at its activation rate (TopK runs only)"),
}
"""Trained TopK matched to a gated run four ways: on its share of zeros over all K dims (sparsity) or on the activation
rate of its live dims, each interpolated with NCL as a point of the curve and on TopK runs alone
(:func:`topk_at_rate`). A representation that closes whole dims (leg's) has many zeros at a high rate, so the two
measures can put it at different points of the curve."""

BASELINES = {**{b: label for b, (_, _, label) in TOPK_BASELINES.items()}, **{c: f"{c} (control)" for c in CONTROLS},
             "ungated": "ungated (same model)", "ncl": "NCL (same seed)",
             "bernoulli": "the bernoulli prior (same seed, gate and settings)"}
"""What a gated run is compared with, seed by seed (:func:`baseline_value`). ``bernoulli``: a run of another prior
against the same method at the default prior, for "does the form of the prior change what the gates select?"."""


def default_prior_name(run: dict) -> str | None:
    """The name of ``run``'s method with the same settings at the ``bernoulli`` prior; None if it is that already.

    compare.py names a run of another prior ``<method>+<prior><settings>`` (``bayesncl-ste+ibp-d0.3``), its family
    ``<method>+<prior>``.
    """
    _, plus, prior = run["family"].partition("+")
    return run["name"].replace(f"+{prior}", "", 1) if plus and run["family"].startswith("bayesncl") else None


def baseline_value(run: dict, baseline: str, key: str, ncl: dict, default: dict | None = None) -> float | None:
    """A baseline's value on one metric for a run, or None.

    ``baseline``: a key of :data:`BASELINES`; ``ncl``: seed -> the NCL run of that seed; ``default``: (seed, name) ->
    the gated runs at the default prior. None where the run has no such baseline.
    """
    if baseline == "bernoulli":
        other = (default or {}).get((run.get("seed"), default_prior_name(run)))
        return None if other is None else other.get(key)
    if baseline in TOPK_BASELINES:
        measure, ending, _ = TOPK_BASELINES[baseline]
        return run.get(f"topk_{key}_at_{measure}{ending}")
    if baseline in CONTROLS:
        return run.get("controls", {}).get(baseline, {}).get(key)
    if baseline == "ungated":
        return run.get(f"{key}_ungated")
    return ncl.get(run.get("seed"), {}).get(key)


def paired(runs: list[dict], metrics: dict = METRICS, baselines: dict = BASELINES) -> list[dict]:
    """Each gated method against each baseline on each metric, paired by seed.

    Against ``baselines`` (keys of :data:`BASELINES`) on ``metrics`` (:data:`METRICS` or :data:`MECHANISM`): one row per
    (method, baseline, metric) with the seeds' differences (method - baseline, fractions), their
    :func:`stats.interval` and ``p_holm``, the row's p adjusted by Holm over every row of this call with a p (the
    family of one table). ``runs``: as :func:`topk_at_rate` returns them (the TopK of each run's own seed).
    """
    ncl = {r.get("seed"): r for r in runs if r["family"] == "ncl"}
    default = {(r.get("seed"), r["name"]): r for r in runs
               if r["family"].startswith("bayesncl") and default_prior_name(r) is None}
    rows = []
    for name in dict.fromkeys(r["name"] for r in runs if r["family"].startswith("bayesncl")):
        mine = [r for r in runs if r["name"] == name]
        for baseline, key in itertools.product(baselines, metrics):
            pairs = [(r["seed"], r[key] - v) for r in mine
                     if key in r and (v := baseline_value(r, baseline, key, ncl, default)) is not None]
            if pairs:
                rows.append(dict(method=name, baseline=BASELINES[baseline], metric=key, seeds=[s for s, _ in pairs],
                                 differences=[d for _, d in pairs], **interval([d for _, d in pairs])))
    tested = [r for r in rows if "p" in r]
    for r, p in zip(tested, holm([r["p"] for r in tested])):
        r["p_holm"] = p
    return rows


def paired_table(rows: list[dict]) -> str:
    """:func:`paired`'s rows as a markdown table, in points (percent)."""
    lines = ["| Method | minus | on | seeds | mean | 95 % CI (t) | 95 % CI (bootstrap) | one-sided 95 % bounds | "
             "TOST p | MDD (80 %) | above / below | p (t) | p (Holm) |", "|" + "---|" * 13]
    for r in rows:
        ci = lambda lo, hi: f"[{100 * r[lo]:+.2f}, {100 * r[hi]:+.2f}]" if lo in r else ""  # noqa: E731
        num = lambda k, f: format(r[k], f) if k in r else ""  # noqa: E731
        bounds = f"> {100 * r['bound_low']:+.2f}, < {100 * r['bound_high']:+.2f}" if "bound_low" in r else ""
        mdd = f"{100 * r['mdd']:.2f}" if "mdd" in r else ""
        lines.append(f"| {r['method']} | {r['baseline']} | {LABELS[r['metric']]} | {r['n']} | {100 * r['mean']:+.2f} "
                     f"| {ci('t_low', 't_high')} | {ci('boot_low', 'boot_high')} | {bounds} | {num('tost_p', '.3f')} "
                     f"| {mdd} | {r['above']} / {r['below']} | {num('p', '.3f')} | {num('p_holm', '.3f')} |")
    return "\n".join(lines)


def plot_paired(rows: list[dict], path):
    """Save :func:`paired_figure` of ``rows`` to ``path``."""
    import matplotlib.pyplot as plt  # late: paired_figure has chosen the Agg backend

    fig = paired_figure(rows)
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def paired_figure(rows: list[dict]):
    """The figure of the paired differences: each seed's, their mean, and both 95 % intervals of the mean.

    One panel a metric of the rows, one row a (method, baseline) labelled with its number of seeds n: the seeds'
    differences (grey dots), their mean (black diamond), the t interval (thick, above the row's line) and the
    percentile bootstrap interval (thin with end caps, below it), drawn apart so that neither hides the other; zero
    marked, and one legend under the panels.
    """
    import matplotlib  # late: only a plot needs it, with the Agg backend chosen first
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # late: after the backend
    from matplotlib.lines import Line2D  # late: as pyplot

    labels = list(dict.fromkeys((r["method"], r["baseline"]) for r in rows))
    seeds = {label: max(r["n"] for r in rows if (r["method"], r["baseline"]) == label) for label in labels}
    keys = list(dict.fromkeys(r["metric"] for r in rows))
    fig, axes = plt.subplots(1, len(keys), figsize=(6.5 * len(keys), 0.45 * len(labels) + 2), sharey=True,
                             squeeze=False)
    for ax, key in zip(axes[0], keys):
        colour, title = f"C{keys.index(key)}", LABELS[key]
        for i, label in enumerate(labels):
            r = next((r for r in rows if (r["method"], r["baseline"]) == label and r["metric"] == key), None)
            if r is None:
                continue
            y = len(labels) - 1 - i
            ax.plot([100 * d for d in r["differences"]], [y] * len(r["differences"]), ".", color="0.55", ms=5)
            if "t_low" in r:
                ax.plot([100 * r["t_low"], 100 * r["t_high"]], [y + 0.18] * 2, color=colour, lw=3)
                ax.errorbar(100 * r["mean"], y - 0.18, xerr=[[100 * (r["mean"] - r["boot_low"])],
                                                             [100 * (r["boot_high"] - r["mean"])]],
                            color="0.25", lw=1, capsize=3, fmt="none")
            ax.plot(100 * r["mean"], y, "D", color="k", ms=4)
        ax.axvline(0, color="k", lw=0.8)
        ax.set_title(f"{title}: method - baseline, same seed (points)", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(labels)), [f"{m} - {b} (n = {seeds[(m, b)]})" for m, b in reversed(labels)],
                          fontsize=7)
    # one legend under the panels, where it hides no row (the t interval's colour is the first panel's)
    fig.legend(handles=[Line2D([], [], ls="", marker=".", color="0.55", label="one seed's difference"),
                        Line2D([], [], ls="", marker="D", color="k", ms=4, label="mean over seeds"),
                        Line2D([], [], color="C0", lw=3, label="95 % CI, Student's t (thick, above)"),
                        Line2D([], [], color="0.25", lw=1, marker="|", label="95 % CI, bootstrap over seeds (below)")],
               fontsize=8, loc="lower center", ncol=4)
    fig.tight_layout(rect=(0, 0.45 / fig.get_figheight(), 1, 1))  # half an inch for the legend
    return fig


MECHANISM_BASELINES = {b: BASELINES[b] for b in (*TOPK_BASELINES, "ncl", "bernoulli")}
"""The baselines :data:`MECHANISM` is paired against: trained TopK (each of its four matchings), NCL, and for another
prior the default one."""

LABELS = {**METRICS, **MECHANISM}
"""Every metric a paired row can be on, by its eval key: what the tables and the figure call it."""


MATCHED_COLUMNS = [("Act.", "activation_rate", 100, ".1f"), ("Sparsity", "sparsity", 100, ".1f"),
                   ("Dims", "active_dims", 1, ".0f"), ("Cons.", "semantic_consistency", 100, ".2f"),
                   ("class dims", "dims_tracking_class", 1, ".1f"), ("bg dims", "dims_tracking_background", 1, ".1f"),
                   ("TopK Cons. at Act.", "topk_semantic_consistency_at_rate", 100, ".2f"),
                   ("TopK class dims at Act.", "topk_dims_tracking_class_at_rate", 1, ".1f"),
                   ("TopK Cons. at Sparsity", "topk_semantic_consistency_at_sparsity", 100, ".2f"),
                   ("TopK Cons. at Sparsity (TopK runs only)", "topk_semantic_consistency_at_sparsity_without_ncl",
                    100, ".2f"),
                   ("TopK class dims at Sparsity", "topk_dims_tracking_class_at_sparsity", 1, ".1f"),
                   ("random-mask Cons.", "semantic_consistency_random_mask", 100, ".2f"),
                   ("random-mask class dims", "dims_tracking_class_random_mask", 1, ".1f"),
                   ("post. mean Cons.", "semantic_consistency_posterior_mean", 100, ".2f"),
                   ("post. mean Act.", "activation_rate_posterior_mean", 100, ".1f"),
                   ("q draws Cons.", "semantic_consistency_q_draws", 100, ".2f"),
                   ("q draws class dims", "dims_tracking_class_q_draws", 1, ".1f"),
                   ("Gates on", "gates_open", 100, ".1f"), ("LP@1", "linear_probe_top1", 100, ".2f"),
                   ("TopK LP@1 at Act.", "topk_linear_probe_top1_at_rate", 100, ".2f"),
                   ("TopK LP@1 at Sparsity", "topk_linear_probe_top1_at_sparsity", 100, ".2f")]
"""compare.py's table at matched sparsity: each run's figures beside the baselines at its own sparsity."""

TOPN_COLUMNS = [("Sparsity", "sparsity", 100, ".1f"), ("Cons. (paper's)", "semantic_consistency", 100, ".2f"),
                ("Cons. top-N", "semantic_consistency_topn", 100, ".2f"),
                ("top-N dims", "topn_coverage_dims", 1, ".1f"), ("top-N images", "topn_coverage_images", 100, ".1f"),
                ("chance", "topn_chance", 100, ".2f"),
                ("TopK top-N at Sparsity", "topk_semantic_consistency_topn_at_sparsity", 100, ".2f"),
                ("TopK top-N at Sparsity (TopK runs only)", "topk_semantic_consistency_topn_at_sparsity_without_ncl",
                 100, ".2f"),
                *((f"{short}: {label}", f"control_{name}_{key}", 100, ".2f")
                  for name, short in (("posthoc_topk", "post-hoc TopK"), ("random_per_image", "random per image"),
                                      ("random_pruned", "random pruned"))
                  for label, key in (("Cons.", "semantic_consistency"), ("top-N", "semantic_consistency_topn"))),
                ("ungated top-N", "semantic_consistency_topn_ungated", 100, ".2f"),
                ("q's mean top-N", "semantic_consistency_topn_posterior_mean", 100, ".2f"),
                ("q draws top-N", "semantic_consistency_topn_q_draws", 100, ".2f")]
"""compare.py's table of the two consistencies: each run's, beside its controls as sparse as F image by image
(eval.json's ``controls``, flattened to ``control_<name>_<key>`` by :func:`flat_controls`)."""


def flat_controls(run: dict) -> dict:
    """A run's eval.json ``controls`` as flat keys (for the tables' means over seeds).

    ``control_<name>_<key>`` for a control's figures, ``control_<name>`` for the overlaps of :data:`MASK_OVERLAP`.
    """
    flat = {}
    for name, figures in run.get("controls", {}).items():
        if isinstance(figures, dict):
            flat.update({f"control_{name}_{k}": v for k, v in figures.items()})
        else:  # a figure of the run's own: the mask overlaps (MASK_OVERLAP)
            flat[f"control_{name}"] = figures
    return flat


def family(fields: dict) -> str:
    """The curve a run belongs to in the matched-sparsity figure.

    The method, TopK and gates named, without the setting (k, D, lambda) that moves it along the curve.
    """
    if fields.get("method") == "bayesncl":
        prior = fields.get("prior", "bernoulli")
        head = fields.get("gate_head", "mlp")
        return f"bayesncl-{fields.get('gate', 'ste')}" + ("" if prior == "bernoulli" else f"+{prior}") + (
            "" if head == "mlp" else f"-{head}")
    if fields.get("method") == "ncl":
        return "ncl+topk" if fields.get("topk") else "ncl"
    return fields.get("method", "?")


def plot_matched(runs: list[dict], path):
    """Plot consistency and LP@1 against activation rate and active entries.

    Against the activation rate of F (top row) and its active entries, 1 - sparsity (bottom row): one curve per family
    (NCL joins NCL+TopK's, as its k = K end), one point per setting at its seeds' mean, the seeds' standard deviation as
    error bars on both axes; for gated runs also the random-mask null's consistency (dotted, bottom row: it keeps F's
    active entries, not its rate).
    """
    import matplotlib  # late: only a plot needs it, with the Agg backend chosen first
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # late: after the backend

    def stats(rs, key):
        vals = [r[key] for r in rs if key in r]
        if not vals:
            return math.nan, 0.0
        m = sum(vals) / len(vals)
        return m, math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0

    curves = {}
    for r in runs:
        fam = "ncl+topk" if r["family"] == "ncl" else r["family"]
        curves.setdefault(fam, {}).setdefault(r["name"], []).append(r)
    fig, axes = plt.subplots(2, 2, figsize=(10, 8))
    for row, (x_key, x_label, flip) in zip(axes, (("activation_rate", "activation rate of F (% of entries of the dims "
                                                  "in use)", False),
                                                 ("sparsity", "active entries of F (% of all K dims)", True))):
        for i, (fam, settings) in enumerate(curves.items()):
            points = sorted(((stats(rs, x_key), rs) for rs in settings.values()), key=lambda p: p[0])
            x = [100 * (1 - p[0][0] if flip else p[0][0]) for p in points]
            xerr = [100 * p[0][1] for p in points]
            for ax, key in zip(row, ("semantic_consistency", "linear_probe_top1")):
                y = [stats(rs, key) for _, rs in points]
                ax.errorbar(x, [100 * m for m, _ in y], xerr=xerr, yerr=[100 * s for _, s in y], marker="o",
                            capsize=3, color=f"C{i}", label=fam)
            if flip:  # the null keeps F's active entries, so it sits at F's point on this axis only
                null = [stats(rs, "semantic_consistency_random_mask") for _, rs in points]
                if not any(math.isnan(m) for m, _ in null):
                    row[0].errorbar(x, [100 * m for m, _ in null], yerr=[100 * s for _, s in null], ls=":",
                                    marker="x", capsize=2, color=f"C{i}", label=f"{fam}: random masks as sparse")
        for ax, label in zip(row, ("semantic consistency (%)", "linear probe top-1 (%)")):
            ax.set_xlabel(x_label)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
