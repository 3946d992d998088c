"""Pairing across seeds: each gated run beside its baselines of the same seed, and the rows compare.py's verdict reads.

A gated run's baselines (:data:`BASELINES`) are NCL of its seed, trained NCL+TopK read off its seed's curve at the
run's own sparsity (:func:`topk_at_rate`), its controls (``matched.CONTROLS``: the same run's features as sparse),
its ungated features and, for another prior, the same seed at the Bernoulli prior. :func:`paired` makes one row per
(method, baseline, metric): the seeds' differences and their ``stats.interval``, the equivalence margin and role
that ``design`` declares, and Holm within the row's family (``design.adjust``). :func:`paired_table` prints them.

Trained TopK is read off a curve of five or six points, linearly between the two nearest (the figure every table
quotes); where the curve bends the reading depends on that choice, so the consistencies are also read by PCHIP
(monotone cubic through the seed's points) and by the quadratic through the three nearest points (:data:`READINGS`),
and each TopK row says what its difference and tests would be under each.
"""

import itertools
import math

from bayesncl_pyro.evaluate import design, keys
from bayesncl_pyro.evaluate.matched import CONTROLS
from bayesncl_pyro.evaluate.stats import interval


def interpolate(x: float, points: list[tuple[float, float]]) -> float | None:
    """Y at x, linear between the two nearest points (x_i, y_i) that bracket x; None outside their range."""
    points = sorted(points)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if points and x == points[0][0]:
        return points[0][1]
    return None


READINGS = {"pchip": "PCHIP through the seed's curve (scipy's PchipInterpolator: monotone between points)",
            "quadratic": "the quadratic through the curve's three points nearest the run"}
"""Other readings of trained TopK's curve, beside the linear one every table quotes: keys ending in ``_<reading>``,
for the keys of :data:`METRICS` only."""


def read_curve(x: float, points: list[tuple[float, float]], reading: str) -> float | None:
    """Y at x read off ``points`` by ``reading`` (a key of :data:`READINGS`); None outside their range of x.

    Points that share an x are averaged first; PCHIP needs two distinct x, the quadratic three.
    """
    by_x = {}
    for px, py in points:
        by_x.setdefault(px, []).append(py)
    xs = sorted(by_x)
    ys = [sum(by_x[v]) / len(by_x[v]) for v in xs]
    if len(xs) < (3 if reading == "quadratic" else 2) or not xs[0] <= x <= xs[-1]:
        return None
    if reading == "pchip":
        from scipy.interpolate import PchipInterpolator  # late: scipy's import costs a second

        return float(PchipInterpolator(xs, ys)(x))
    near = sorted(range(len(xs)), key=lambda i: abs(xs[i] - x))[:3]
    return sum(ys[i] * math.prod((x - xs[j]) / (xs[i] - xs[j]) for j in near if j != i) for i in near)


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


def topk_at_rate(runs: list[dict]) -> list[dict]:
    """Give each run NCL+TopK's figures at its own activation rate and sparsity, with and without NCL on the curve.

    ``runs`` (compare.py's: dicts with ``name``, ``family``, ``seed`` and their eval figures), each given the NCL+TopK
    curve of its own seed at its own activation rate and at its own sparsity: ``topk_<key>_at_rate`` and
    ``topk_<key>_at_sparsity`` for the keys in TOPK_KEYS, interpolated linearly in that measure between the two nearest
    settings of that seed with NCL as a point of the curve (TopK with every dim kept), and the same keys ending in
    ``_without_ncl`` between the two nearest TopK runs alone. The two differ where NCL is one of the two nearest
    points: NCL is sparser than a large k on some data (CIFAR-100's CPU arm: NCL 89 % zeros, TopK 32 88 %), and then
    brackets a gated run with a TopK run. Each is left out where the run lies outside its curve's range. A seed's curve
    is never averaged with another's: the seed draws the data too (the generated benchmark's test split). Runs of the
    curve itself get nothing. For the keys of :data:`METRICS`, each reading of :data:`READINGS` too, its key ending in
    ``_<reading>``. Every key is ``keys.topk``'s.
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
            for alone, curve in ((False, with_ncl), (True, [c for c in with_ncl if c["family"] == "ncl+topk"])):
                if len(curve) < 2:
                    continue
                for (measure, x), key in itertools.product(MATCH_ON.items(), TOPK_KEYS):
                    points = [(c[x], c[key]) for c in curve if key in c]
                    value = interpolate(r[x], points)
                    if value is not None:
                        r[keys.topk(key, measure, alone)] = value
                    for reading in READINGS if key in METRICS else ():
                        value = read_curve(r[x], points, reading)
                        if value is not None:
                            r[keys.topk(key, measure, alone, reading)] = value
        out.append(r)
    return out


METRICS = {"semantic_consistency": "the paper's consistency", "semantic_consistency_topn": "top-N consistency"}
"""The two consistencies every paired comparison is made on."""

TOPK_BASELINES = {
    "topk": ("sparsity", False, "trained TopK at its sparsity (NCL on the curve)"),
    "topk_without_ncl": ("sparsity", True, "trained TopK at its sparsity (TopK runs only)"),
    "topk_rate": ("rate", False, "trained TopK at its activation rate (NCL on the curve)"),
    "topk_rate_without_ncl": ("rate", True, "trained TopK at its activation rate (TopK runs only)"),
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


def baseline_value(run: dict, baseline: str, key: str, ncl: dict, default: dict | None = None,
                   reading: str = "") -> float | None:
    """A baseline's value on one metric for a run, or None.

    ``baseline``: a key of :data:`BASELINES`; ``ncl``: seed -> the NCL run of that seed; ``default``: (seed, name) ->
    the gated runs at the default prior; ``reading``: for trained TopK, a key of :data:`READINGS` ("" for the linear
    reading). None where the run has no such baseline.
    """
    if baseline == "bernoulli":
        other = (default or {}).get((run.get("seed"), default_prior_name(run)))
        return None if other is None else other.get(key)
    if baseline in TOPK_BASELINES:
        measure, alone, _ = TOPK_BASELINES[baseline]
        return run.get(keys.topk(key, measure, alone, reading))
    if baseline in CONTROLS:
        return run.get("controls", {}).get(baseline, {}).get(key)
    if baseline == "ungated":
        return run.get(keys.format(key, keys.UNGATED))
    return ncl.get(run.get("seed"), {}).get(key)


def _compared(mine: list[dict], baseline: str, key: str, ncl: dict, default: dict, reading: str = "") -> dict | None:
    """One method's runs ``mine`` against one baseline on ``key``, seed by seed.

    The seeds, the differences and their ``stats.interval`` with the TOST at ``design.margin`` of the baseline's
    values; None where no seed has the baseline.
    """
    pairs = [(r["seed"], r[key], v) for r in mine
             if key in r and (v := baseline_value(r, baseline, key, ncl, default, reading)) is not None]
    if not pairs:
        return None
    differences = [a - b for _, a, b in pairs]
    return dict(seeds=[s for s, _, _ in pairs], differences=differences,
                **interval(differences, margin=design.margin([b for _, _, b in pairs])))


def paired(runs: list[dict], metrics: dict = METRICS, baselines: dict = BASELINES) -> list[dict]:
    """Each gated method against each baseline on each metric, paired by seed.

    Against ``baselines`` (keys of :data:`BASELINES`) on ``metrics`` (:data:`METRICS` or :data:`MECHANISM`): one row per
    (method, baseline, metric) with the seeds' differences (method - baseline, fractions), their
    :func:`stats.interval` with the TOST at ``design.margin`` of the baseline's values over those seeds, the row's
    ``role`` (``design.role``: primary or exploratory) and, from ``design.adjust``, its Holm-adjusted p within its
    family (``p_holm``; ``tost_p_holm`` in the primary family) and the family's name (``holm_family``). A trained TopK
    row on :data:`METRICS` also has ``readings``: for each of :data:`READINGS`, the same comparison with TopK read off
    its curve that way. ``runs``: as :func:`topk_at_rate` returns them (the TopK of each run's own seed).
    """
    ncl = {r.get("seed"): r for r in runs if r["family"] == "ncl"}
    default = {(r.get("seed"), r["name"]): r for r in runs
               if r["family"].startswith("bayesncl") and default_prior_name(r) is None}
    rows = []
    for name in dict.fromkeys(r["name"] for r in runs if r["family"].startswith("bayesncl")):
        mine = [r for r in runs if r["name"] == name]
        for baseline, key in itertools.product(baselines, metrics):
            row = _compared(mine, baseline, key, ncl, default)
            if row is None:
                continue
            row = dict(method=name, baseline=BASELINES[baseline], metric=key, **row,
                       role=design.role(mine[0]["family"], baseline, key))
            if baseline == "bernoulli":  # the run it is compared with, which names the priors' Holm family
                row["baseline_run"] = default_prior_name(mine[0])
            if baseline in TOPK_BASELINES and key in METRICS:
                others = {reading: _compared(mine, baseline, key, ncl, default, reading) for reading in READINGS}
                row["readings"] = {reading: {k: v for k, v in other.items() if k in READING_FIGURES}
                                   for reading, other in others.items() if other is not None}
            rows.append(row)
    return design.adjust(rows)


READING_FIGURES = ("n", "seeds", "mean", "t_low", "t_high", "p", "tost_p", "margin")
"""What a row keeps of each other reading of trained TopK (``readings``)."""


MECHANISM_BASELINES = {b: BASELINES[b] for b in (*TOPK_BASELINES, "ncl", "bernoulli")}
"""The baselines :data:`MECHANISM` is paired against: trained TopK (each of its four matchings), NCL, and for another
prior the default one."""

LABELS = {**METRICS, **MECHANISM}
"""Every metric a paired row can be on, by its eval key: what the tables and the figure call it."""


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




def _reading_cell(r: dict) -> str:
    """A TopK row's other readings of its curve, in a cell.

    Each reading's mean difference in points, p and TOST p (and both Holm-adjusted in the primary family).
    """
    cells = []
    for reading in READINGS:
        o = r.get("readings", {}).get(reading)
        if o is None or "p" not in o:
            continue
        holm = f" (Holm {o['p_holm']:.3f} / {o['tost_p_holm']:.3f})" if "p_holm" in o else ""
        cells.append(f"{reading} {100 * o['mean']:+.2f}, p {o['p']:.3f}, TOST {o['tost_p']:.3f}{holm}")
    return "; ".join(cells)


def paired_table(rows: list[dict]) -> str:
    """:func:`paired`'s rows as a markdown table, in points (percent).

    The margin is the TOST's (``design.margin``); p (Holm) is within the row's family, and TOST p (Holm) is given in
    the primary family only, which adjusts both; the last column, for trained TopK, its other readings.
    """
    head = ["Method", "minus", "on", "seeds", "mean", "95 % CI (t)", "95 % CI (bootstrap)", "one-sided 95 % bounds",
            "margin", "TOST p", "MDD (80 %)", "above / below", "p (t)", "p (Holm)", "TOST p (Holm)",
            "TopK read otherwise"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ci = lambda lo, hi: f"[{100 * r[lo]:+.2f}, {100 * r[hi]:+.2f}]" if lo in r else ""  # noqa: E731
        num = lambda k, f, scale=1: format(scale * r[k], f) if k in r else ""  # noqa: E731
        bounds = f"> {100 * r['bound_low']:+.2f}, < {100 * r['bound_high']:+.2f}" if "bound_low" in r else ""
        lines.append(f"| {r['method']} | {r['baseline']} | {LABELS[r['metric']]} | {r['n']} | {100 * r['mean']:+.2f} "
                     f"| {ci('t_low', 't_high')} | {ci('boot_low', 'boot_high')} | {bounds} | "
                     f"{num('margin', '.2f', 100)} | {num('tost_p', '.3f')} | {num('mdd', '.2f', 100)} | "
                     f"{r['above']} / {r['below']} | {num('p', '.3f')} | {num('p_holm', '.3f')} | "
                     f"{num('tost_p_holm', '.3f')} | {_reading_cell(r)} |")
    return "\n".join(lines)
