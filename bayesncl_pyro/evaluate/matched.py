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


def count_matched_controls(ungated: torch.Tensor, features: torch.Tensor, labels: torch.Tensor,
                           factors: dict | None = None, seed: int = 0) -> dict:
    """The controls that separate the gates' selection from what training did to the encoder.

    Returns ``{name: figures}``, :func:`summary`'s and the sparsity of normalise(u * mask), averaged over each control's
    :func:`control_masks`. ungated: N x K u, features: N x K F, labels: N.
    """
    def figures(mask):
        x = normalize(ungated * mask)
        return dict(summary(x, labels, factors), sparsity=sparsity(x))

    return {name: _mean([figures(m) for m in masks], "")
            for name, masks in control_masks(ungated, features, seed).items()}


def interpolate(x: float, points: list[tuple[float, float]]) -> float | None:
    """Y at x, linear between the two nearest points (x_i, y_i) that bracket x; None outside their range."""
    points = sorted(points)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if points and x == points[0][0]:
        return points[0][1]
    return None


TOPK_KEYS = ("semantic_consistency", "semantic_consistency_topn", "dims_tracking_class", "linear_probe_top1")


MATCH_ON = {"rate": "activation_rate", "sparsity": "sparsity"}
"""The two measures of sparsity a run is matched on: the activation rate (the reference's: the share of active
entries among the dims in use, so a representation that closes whole dims can be sparse and still have a high rate)
and the share of zero entries over all K dims (what a TopK's k fixes, and what the random-mask null keeps)."""


def topk_at_rate(runs: list[dict]) -> list[dict]:
    """Give each run NCL+TopK's figures at its own activation rate and sparsity.

    ``runs`` (compare.py's: dicts with ``name``, ``family``, ``seed`` and their eval figures), each given the NCL+TopK
    curve of its own seed at its own activation rate and at its own sparsity: ``topk_<key>_at_rate`` and
    ``topk_<key>_at_sparsity`` for the keys in TOPK_KEYS, interpolated linearly in that measure between the two nearest
    TopK settings of that seed (NCL, TopK with every dim kept, is a point of the curve) and left out where the run lies
    outside the curve's range. A seed's curve is never averaged with another's: the seed draws the data too (the
    generated benchmark's test split). Runs of the curve itself get nothing.
    """
    curves = {}
    for r in runs:
        if r["family"] in ("ncl+topk", "ncl"):
            curves.setdefault(r.get("seed"), []).append(r)
    out = []
    for r in runs:
        r = dict(r)
        curve = curves.get(r.get("seed"), [])
        if r["family"] not in ("ncl+topk", "ncl") and len(curve) >= 2:
            for (suffix, x), key in itertools.product(MATCH_ON.items(), TOPK_KEYS):
                value = interpolate(r[x], [(c[x], c[key]) for c in curve if key in c])
                if value is not None:
                    r[f"topk_{key}_at_{suffix}"] = value
        out.append(r)
    return out


METRICS = {"semantic_consistency": "the paper's consistency", "semantic_consistency_topn": "top-N consistency"}
"""The two consistencies every paired comparison is made on."""

BASELINES = {"topk": "trained TopK at its sparsity", **{c: f"{c} (control)" for c in CONTROLS},
             "ungated": "ungated (same model)", "ncl": "NCL (same seed)"}
"""What a gated run is compared with, seed by seed (:func:`baseline_value`)."""


def baseline_value(run: dict, baseline: str, key: str, ncl: dict) -> float | None:
    """A baseline's value on one metric for a run, or None.

    ``baseline``: a key of :data:`BASELINES`; ``ncl``: seed -> the NCL run of that seed. None where the run has no such
    baseline.
    """
    if baseline == "topk":
        return run.get(f"topk_{key}_at_sparsity")
    if baseline in CONTROLS:
        return run.get("controls", {}).get(baseline, {}).get(key)
    if baseline == "ungated":
        return run.get(f"{key}_ungated")
    return ncl.get(run.get("seed"), {}).get(key)


BOOTSTRAP = 10_000
"""Resamples of the seeds' differences behind the bootstrap interval."""


def interval(differences: list[float], level: float = 0.95, seed: int = 0) -> dict:
    """Mean of paired differences with t and bootstrap confidence intervals.

    ``differences``: one per seed; the ``level`` interval two ways: Student's t (``t_low``, ``t_high``, and the
    two-sided ``p`` of a zero mean) and the percentile bootstrap over seeds (``boot_low``, ``boot_high``:
    :data:`BOOTSTRAP` seeded resamples), and the sign count (``above``, ``below``).
    """
    from scipy import stats  # late: scipy's import costs a second, and only the comparison's tables need it

    d = torch.tensor(differences, dtype=torch.float64)
    n, mean = len(d), float(d.mean())
    out = dict(n=n, mean=mean, above=int((d > 0).sum()), below=int((d < 0).sum()))
    if n < 2:
        return out
    sd = float(d.std())
    half = stats.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    p = float(2 * stats.t.sf(abs(mean) / (sd / math.sqrt(n)), n - 1)) if sd > 0 else (0.0 if mean else 1.0)
    g = torch.Generator().manual_seed(seed)
    means = d[torch.randint(n, (BOOTSTRAP, n), generator=g)].mean(dim=1)
    low, high = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return dict(out, sd=sd, t_low=mean - half, t_high=mean + half, p=p, boot_low=float(low), boot_high=float(high))


def paired(runs: list[dict]) -> list[dict]:
    """Each gated method against each baseline on each metric, paired by seed.

    Against :data:`BASELINES` on :data:`METRICS`: one row per (method, baseline, metric) with the seeds' differences
    (method - baseline, fractions) and their :func:`interval`. ``runs``: as :func:`topk_at_rate` returns them (the TopK
    of each run's own seed).
    """
    ncl = {r.get("seed"): r for r in runs if r["family"] == "ncl"}
    rows = []
    for name in dict.fromkeys(r["name"] for r in runs if r["family"].startswith("bayesncl")):
        mine = [r for r in runs if r["name"] == name]
        for baseline, key in itertools.product(BASELINES, METRICS):
            pairs = [(r["seed"], r[key] - v) for r in mine
                     if key in r and (v := baseline_value(r, baseline, key, ncl)) is not None]
            if pairs:
                rows.append(dict(method=name, baseline=BASELINES[baseline], metric=key, seeds=[s for s, _ in pairs],
                                 differences=[d for _, d in pairs], **interval([d for _, d in pairs])))
    return rows


def paired_table(rows: list[dict]) -> str:
    """:func:`paired`'s rows as a markdown table, in points (percent)."""
    lines = ["| Method | minus | on | seeds | mean | 95 % CI (t) | 95 % CI (bootstrap) | above / below | p (t) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ci = lambda lo, hi: f"[{100 * r[lo]:+.2f}, {100 * r[hi]:+.2f}]" if lo in r else ""  # noqa: E731
        lines.append(f"| {r['method']} | {r['baseline']} | {METRICS[r['metric']]} | {r['n']} | {100 * r['mean']:+.2f} "
                     f"| {ci('t_low', 't_high')} | {ci('boot_low', 'boot_high')} | {r['above']} / {r['below']} | "
                     + (f"{r['p']:.3f}" if "p" in r else "") + " |")
    return "\n".join(lines)


def plot_paired(rows: list[dict], path):
    """Plot the paired differences as intervals.

    One panel a metric, one row a (method, baseline), the mean with its t interval (thick) and bootstrap interval
    (thin), zero marked.
    """
    import matplotlib  # late: only a plot needs it, with the Agg backend chosen first
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # late: after the backend

    labels = list(dict.fromkeys((r["method"], r["baseline"]) for r in rows))
    fig, axes = plt.subplots(1, len(METRICS), figsize=(6 * len(METRICS), 0.35 * len(labels) + 1.5), sharey=True)
    for ax, (key, title) in zip(axes, METRICS.items()):
        for i, label in enumerate(labels):
            r = next((r for r in rows if (r["method"], r["baseline"]) == label and r["metric"] == key), None)
            if r is None:
                continue
            y = len(labels) - 1 - i
            if "t_low" in r:
                ax.plot([100 * r["boot_low"], 100 * r["boot_high"]], [y, y], color="0.6", lw=1)
                ax.plot([100 * r["t_low"], 100 * r["t_high"]], [y, y], color=f"C{list(METRICS).index(key)}", lw=3)
            ax.plot(100 * r["mean"], y, "o", color="k", ms=4)
        ax.axvline(0, color="k", lw=0.8)
        ax.set_title(f"{title}: method - baseline (points)", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(labels)), [f"{m} - {b}" for m, b in reversed(labels)], fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


MATCHED_COLUMNS = [("Act.", "activation_rate", 100, ".1f"), ("Sparsity", "sparsity", 100, ".1f"),
                   ("Dims", "active_dims", 1, ".0f"), ("Cons.", "semantic_consistency", 100, ".2f"),
                   ("class dims", "dims_tracking_class", 1, ".1f"), ("bg dims", "dims_tracking_background", 1, ".1f"),
                   ("TopK Cons. at Act.", "topk_semantic_consistency_at_rate", 100, ".2f"),
                   ("TopK class dims at Act.", "topk_dims_tracking_class_at_rate", 1, ".1f"),
                   ("TopK Cons. at Sparsity", "topk_semantic_consistency_at_sparsity", 100, ".2f"),
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
    """A run's eval.json ``controls`` as flat keys ``control_<name>_<key>`` (for the tables' means over seeds)."""
    return {f"control_{name}_{k}": v for name, figures in run.get("controls", {}).items() for k, v in figures.items()}


def family(fields: dict) -> str:
    """The curve a run belongs to in the matched-sparsity figure.

    The method, TopK and gates named, without the setting (k, D, lambda) that moves it along the curve.
    """
    if fields.get("method") == "bayesncl":
        prior = fields.get("prior", "bernoulli")
        return f"bayesncl-{fields.get('gate', 'ste')}" + ("" if prior == "bernoulli" else f"+{prior}")
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
