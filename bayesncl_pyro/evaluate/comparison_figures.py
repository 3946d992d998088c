"""The figures of a comparison: consistency against the probe, the matched-sparsity curves, the paired differences.

Every figure here is drawn by matplotlib with the Agg backend (:func:`pyplot`, the one place it is chosen: a comparison
runs on machines without a display). Each ``*_figure`` returns its figure, which :func:`png` writes as one file of a
set (``rundir.save_together``: a comparison's files land together); ``plot*`` write one figure alone.
"""

import math
from pathlib import Path

from bayesncl_pyro.evaluate import keys
from bayesncl_pyro.evaluate.pairing import LABELS
from bayesncl_pyro.evaluate.stats import mean_sd
from bayesncl_pyro.rundir import save_figure

DPI = 120


def pyplot():
    """Pyplot with the Agg backend chosen first, imported late: only a figure needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig):
    """The writer of ``fig`` as a PNG into a binary file: an item of ``rundir.save_together``."""
    return lambda f: fig.savefig(f, format="png", dpi=DPI)


def save(fig, path: Path):
    """Write ``fig`` alone to ``path`` (``rundir.save_figure``) and close it."""
    try:
        save_figure(fig, path, dpi=DPI)
    finally:
        pyplot().close(fig)


def plot(runs: list[dict], path: Path):
    """Save :func:`consistency_figure` of ``runs`` to ``path``."""
    save(consistency_figure(runs), path)


def consistency_figure(runs: list[dict]):
    """Each run's semantic consistency against its linear-probe top-1."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5, 4))
    names = list(dict.fromkeys(r["name"] for r in runs))
    for i, name in enumerate(names):
        rs = [r for r in runs if r["name"] == name]
        ax.scatter([100 * r["linear_probe_top1"] for r in rs], [100 * r["semantic_consistency"] for r in rs],
                   label=name, color=f"C{i}")
    ax.set_xlabel("linear probe top-1 (%)")
    ax.set_ylabel("semantic consistency (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_paired(rows: list[dict], path):
    """Save :func:`paired_figure` of ``rows`` to ``path``."""
    save(paired_figure(rows), path)


def paired_figure(rows: list[dict]):
    """The figure of the paired differences: each seed's, their mean, and both 95 % intervals of the mean.

    One panel a metric of the rows, one row a (method, baseline) labelled with its number of seeds n: the seeds'
    differences (grey dots), their mean (black diamond), the t interval (thick, above the row's line) and the
    percentile bootstrap interval (thin with end caps, below it), drawn apart so that neither hides the other; zero
    marked, and one legend under the panels.
    """
    plt = pyplot()
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


def plot_matched(runs: list[dict], path):
    """Save :func:`matched_figure` of ``runs`` to ``path``."""
    save(matched_figure(runs), path)


def matched_figure(runs: list[dict]):
    """Consistency and LP@1 against activation rate and active entries.

    Against the activation rate of F (top row) and its active entries, 1 - sparsity (bottom row): one curve per family
    (NCL joins NCL+TopK's, as its k = K end), one point per setting at its seeds' mean, the seeds' standard deviation as
    error bars on both axes; for gated runs also the random-mask null's consistency (dotted, bottom row: it keeps F's
    active entries, not its rate).
    """
    plt = pyplot()

    def stats(rs, key):
        values = [r[key] for r in rs if key in r]
        return mean_sd(values) if values else (math.nan, 0.0)

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
                null = [stats(rs, keys.format("semantic_consistency", keys.RANDOM_MASK)) for _, rs in points]
                if not any(math.isnan(m) for m, _ in null):
                    row[0].errorbar(x, [100 * m for m, _ in null], yerr=[100 * s for _, s in null], ls=":",
                                    marker="x", capsize=2, color=f"C{i}", label=f"{fam}: random masks as sparse")
        for ax, label in zip(row, ("semantic consistency (%)", "linear probe top-1 (%)")):
            ax.set_xlabel(x_label)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
    fig.tight_layout()
    return fig
