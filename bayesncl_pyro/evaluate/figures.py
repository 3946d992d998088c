"""A run's figures and summary (experiments/inspect_gates.py).

The training log's terms, the gate posterior on the test split (KL per dimension, inclusion probabilities, the class x
dimension heatmap), the most class-consistent dimensions' top images, and the InfoNCE gradient conflict beside a
baseline's. Their style (``plt.rcParams`` below) and :func:`save` serve the novelty ROC curves too
(``novelty_figures``).
"""

import contextlib
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bayesncl_pyro._deprecated import moved  # noqa: E402
from bayesncl_pyro.data import load_dataset  # noqa: E402
from bayesncl_pyro.errors import UserError  # noqa: E402
from bayesncl_pyro.evaluate import dimensions as dm  # noqa: E402
from bayesncl_pyro.evaluate.diagnostics import (  # noqa: E402
    budget_note,
    conflict_lines,
    conflict_table,
    read_conflict,
    trained_steps,
)
from bayesncl_pyro.evaluate.heldout import test_features  # noqa: E402
from bayesncl_pyro.evaluate.loading import load_learner  # noqa: E402
from bayesncl_pyro.evaluate.posterior import prior_rate  # noqa: E402
from bayesncl_pyro.infer.estimators import GateEstimator, gate_class  # noqa: E402
from bayesncl_pyro.rundir import (  # noqa: E402
    INSPECT_DIR,
    RunFolder,
    atomic_save,
    held,
    output_folder,
    read_log,
    run_folder,
    save_figure,
)

plt.rcParams.update({"figure.dpi": 110, "font.size": 10, "axes.titlesize": 11, "axes.grid": True,
                     "grid.alpha": 0.3, "text.parse_math": False})  # class names are text: a "$" is no formula


def save(fig, path: Path, tight: bool = True, **savefig) -> Path:
    """Write ``fig`` as a PNG to ``path`` atomically.

    By ``rundir.save_figure`` (a temporary file, renamed, never through a link), laid out first by tight_layout
    (``tight``) where it has no layout engine.
    """
    if tight and fig.get_layout_engine() is None:
        fig.tight_layout()
    save_figure(fig, path, **savefig)
    plt.close(fig)
    return path


def plot_elbo(log: list[dict], estimator: type[GateEstimator] | None, kl_weight: float, path: Path) -> Path:
    """Plot the training log's terms over the steps.

    Titled by what the log's fields are: for a gated run ``loss`` (what the gate estimator minimised: -ELBO per row, or
    the reference's surrogate), ``nce`` and ``kl``; without gates (``estimator`` None) the loss is InfoNCE alone.
    """
    steps = [r["step"] for r in log]
    if estimator is not None:
        panels = [("loss", f"{estimator.loss_name} (log's loss)\n= nce + lambda * kl, lambda = {kl_weight:g}"),
                  ("nce", "InfoNCE per row (log's nce)\nat the gate values training used"),
                  ("kl", "KL term per row (log's kl)\nas trained, summed over dims")]
    else:
        panels = [("loss", "InfoNCE per row (log's loss)\nthe whole objective")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6), layout="constrained")
    for ax, (key, title) in zip(np.atleast_1d(axes), panels):
        ax.plot(steps, [r[key] for r in log], lw=1.2)
        ax.set(title=title, xlabel="training step", ylabel="nats")
    return save(fig, path)


def _dim_ticks(ax, order):
    """Label the columns with dimension ids when there are few enough to read."""
    if len(order) <= 64:
        ax.set_xticks(np.arange(len(order)), [str(k) for k in order], fontsize=6, rotation=90)
        ax.grid(False, axis="x")


def plot_kl_per_dim(kl: np.ndarray, label: str, path: Path) -> Path:
    """Plot KL per dimension, largest first.

    Bars labelled by dimension for up to 64 dims, else the sorted curve with its five largest dimensions named.
    """
    order = np.argsort(kl)[::-1]
    fig, ax = plt.subplots(figsize=(7.5, 3.6), layout="constrained")
    if len(kl) <= 64:
        ax.bar(np.arange(len(kl)), kl[order], color="tab:purple")
        _dim_ticks(ax, order)
        ax.set_xlabel("dimension (sorted by KL)")
    else:
        ax.plot(np.arange(1, len(kl) + 1), kl[order], color="tab:purple", lw=1.5)
        for rank, k in enumerate(order[:5]):
            ax.annotate(f"dim {k}", (rank + 1, kl[k]), xytext=(8, -4 - 9 * rank), textcoords="offset points",
                        fontsize=7)
        ax.set(xscale="log", xlabel=f"rank of the dimension by KL (1 = largest, of {len(kl)})")
    ax.set(title="\n".join(textwrap.wrap(f"{label} (a hierarchical prior at q(rate)'s mean)", 80)),
           ylabel="KL (nats)")
    return save(fig, path)


def plot_inclusion(probs: np.ndarray, prior_rate: float, path: Path) -> Path:
    """Plot histograms of the inclusion probabilities, per entry and per dimension's mean."""
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    a.hist(probs.ravel(), bins=50, range=(0, 1), color="tab:blue")
    a.axvline(0.5, color="k", ls="--", lw=1, label="gate threshold 0.5")
    a.axvline(prior_rate, color="tab:red", ls=":", lw=1.5, label=f"prior rate {prior_rate:.2f}")
    a.set(title="inclusion probability, every (image, dimension)", xlabel="q(g_k = 1 | x)",
          ylabel="count of (image, dim) pairs")
    a.legend(fontsize=8)
    b.hist(probs.mean(0), bins=25, range=(0, 1), color="tab:orange")
    b.set(title="mean inclusion per dimension", xlabel="mean over test images of q(g_k = 1 | x)",
          ylabel="number of dimensions")
    return save(fig, path)


def heatmap_order(class_means: np.ndarray) -> np.ndarray:
    """Dimension order for the class heatmap, most class-specific first within each class.

    Dimensions are grouped by the class they include most, each group sorted by how much more that class includes them
    than the other classes do (most class-specific first).
    """
    top = class_means.argmax(0)
    specificity = class_means.max(0) - class_means.mean(0)
    return np.lexsort((-specificity, top))


def plot_class_heatmap(class_means: np.ndarray, classes: list[str], path: Path) -> Path:
    """Plot mean inclusion per class and dimension, raw and centred per dimension.

    Top: mean inclusion per class (``dimensions.inclusion_by_class``); bottom: the same minus the dimension's mean over
    classes, where a class-specific dimension stands out as one warm cell in a cool column.
    """
    order = heatmap_order(class_means)
    k, c = len(order), len(classes)
    fig, axes = plt.subplots(2, 1, figsize=(min(16.0, max(7.0, 0.16 * k + 2.5)), 0.6 * c + 3.2), sharex=True)
    deviation = class_means - class_means.mean(0)
    span = max(float(np.abs(deviation).max()), 1e-3)
    panels = [(class_means, "viridis", 0, 1, "mean q(g_k = 1 | x)",
               "mean inclusion probability per class and dimension"),
              (deviation, "RdBu_r", -span, span, "minus the dim's\nmean over classes",
               "the same, minus each dimension's mean over classes: class-specific dimensions stand out")]
    preferred = class_means.argmax(0)[order]
    for ax, (values, cmap, lo, hi, label, title) in zip(axes, panels):
        im = ax.imshow(values[:, order], aspect="auto", cmap=cmap, vmin=lo, vmax=hi, interpolation="nearest")
        ax.set_yticks(np.arange(c), classes)
        ax.set(title=title, ylabel="class")
        ax.grid(False)
        for x in np.flatnonzero(preferred[1:] != preferred[:-1]):
            ax.axvline(x + 0.5, color="k", lw=0.8)
        fig.colorbar(im, ax=ax, label=label, fraction=0.03, pad=0.01)
    axes[1].set_xlabel("dimension, grouped by the class that includes it most (lines separate the groups)")
    _dim_ticks(axes[1], order)
    return save(fig, path)


def _image(item) -> tuple[np.ndarray, str | None]:
    """A dataset image (uint8 C x H x W tensor or PIL image) as an array for imshow, and its colormap."""
    image = item if not torch.is_tensor(item) else item.permute(1, 2, 0).numpy()
    image = np.asarray(image)
    return (image[..., 0], "gray_r") if image.ndim == 3 and image.shape[2] == 1 else (image, None)


def plot_top_images(features, labels, dataset, classes, path: Path, dims: int = 8, per_dim: int = 10) -> Path:
    """Plot the top test images of the most class-consistent dimensions.

    Dimensions are chosen among those active in at least ``dimensions.min_support`` test images, a row each, labelled by
    what the row shows.
    """
    least = dm.min_support(len(labels), len(classes))
    chosen = dm.consistent_dims(features, labels, len(classes), dims, least)
    if not chosen:
        raise UserError(f"no dimension is active in {least} or more test images; the representation has collapsed")
    share, dominant = dm.consistency(dm.class_counts(features, labels, len(classes)))
    active = dm.support(features)
    top = dm.Ranking(features).top(torch.tensor(chosen), per_dim)
    fig, axes = plt.subplots(len(chosen), per_dim, figsize=(1.05 * per_dim + 2.2, 1.1 * len(chosen) + 0.8),
                             squeeze=False)
    for row, k in enumerate(chosen):
        shown = [i for i in top[row].tolist() if i >= 0]
        for ax, i in zip(axes[row], shown):
            image, cmap = _image(dataset[i][0])
            ax.imshow(image, cmap=cmap, interpolation="nearest")
            ax.set_title(classes[labels[i]], fontsize=8, pad=2)
        for ax in axes[row]:
            ax.set(xticks=[], yticks=[])
            ax.grid(False)
            if not ax.images:
                ax.axis("off")
        first = torch.bincount(labels[shown], minlength=len(classes)).argmax().item()
        same = sum(labels[i] == first for i in shown)
        axes[row, 0].set_ylabel(f"dim {k}: {same} of {len(shown)} '{classes[first]}'\nof its {int(active[k])} "
                                f"active:\n{share[k]:.0%} '{classes[dominant[k]]}'", rotation=0, ha="right",
                                va="center", fontsize=8)
    fig.suptitle(f"the {len(chosen)} most class-consistent dimensions active in at least {least} test images, and "
                 f"their {per_dim} test images of largest activation\n(row label: the shown images' most frequent "
                 "class; the share of all its active images in its dominant class; title: the image's class)",
                 fontsize=10)
    return save(fig, path)


def top_dimensions_line(features, labels, classes, n: int = 8) -> str:
    """The summary's line on the most class-consistent dimensions (as ``top_images.png`` ranks them)."""
    least = dm.min_support(len(labels), len(classes))
    share, dominant = dm.consistency(dm.class_counts(features, labels, len(classes)))
    active = dm.support(features)
    dims = dm.consistent_dims(features, labels, len(classes), n, least)
    return f"most class-consistent dims (active in >= {least} test images): " + ", ".join(
        f"{k} ({share[k]:.0%} '{classes[dominant[k]]}', {int(active[k])} on)" for k in dims)


_SUPERSCRIPT = str.maketrans("-0123456789", "\u207b\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079")


def power_of_ten(value: float, position=None) -> str:
    """A log axis' tick label as plain text: ``10⁴`` for 10,000, "" between the powers of ten.

    matplotlib's own log labels are mathtext (``$`` and ``mathdefault`` around ``10^{4}``), which this module's
    ``text.parse_math = False`` (class names are text) would print raw.
    """
    if value <= 0:
        return ""
    exponent = round(float(np.log10(value)))
    return f"10{str(exponent).translate(_SUPERSCRIPT)}" if np.isclose(value, 10.0 ** exponent) else ""


def plot_conflict(main: dict, name: str, baseline: dict | None, baseline_name: str, path: Path) -> Path:
    """Plot a run's per-dimension gradient conflict beside a baseline's into ``path`` (:func:`conflict_figure`)."""
    return save(conflict_figure(main, name, baseline, baseline_name), path, tight=False, bbox_inches="tight")


def conflict_figure(main: dict, name: str, baseline: dict | None, baseline_name: str):
    """A run's per-dimension gradient conflict beside a baseline's, as a matplotlib figure (three panels)."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.0))
    panels = [("cancellation", "pull of positives vs push of negatives", "cancellation (1 = they cancel)",
               "linear"),
              ("oscillation", "what is left after cancelling", "var / mean^2 of the net gradient", "log"),
              ("sign_flips", "direction changes of the net gradient", "share of records with a sign flip",
               "linear")]
    for ax, (key, title, ylabel, scale) in zip(axes, panels):
        if baseline is not None:
            ax.scatter(baseline["freq"], baseline[key], s=14, c="0.6", marker="x", label=baseline_name)
        if "incl" in main:
            sc = ax.scatter(main["freq"], main[key], s=18, c=main["incl"], cmap="coolwarm_r", vmin=0, vmax=1,
                            edgecolors="k", linewidths=0.3, label=f"{name} (colour: mean inclusion)")
        else:
            ax.scatter(main["freq"], main[key], s=18, c="tab:blue", label=name)
        ax.set(title=title, ylabel=ylabel, yscale=scale)
        if scale == "log":
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(power_of_ten))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.title.set_fontsize(9.5)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.supxlabel("activation frequency of the dimension (share of rows in which it takes part in the loss)",
                  fontsize=10)
    fig.suptitle("InfoNCE gradient conflict, one point per dimension (right: dims shared by most images)",
                 fontsize=11)
    fig.tight_layout()
    if "incl" in main:
        fig.colorbar(sc, ax=axes, label="mean inclusion probability of the dim's gate\non the logged training batches",
                     fraction=0.02, pad=0.01)
    return fig


def inspect(run_dir: Path, out: Path | None = None, baseline: Path | None = None, export: bool = False,
            **load) -> list[str]:
    """Write a run's figures into ``out`` and return its summary lines (``experiments/inspect_gates.py``).

    Everything is read from the run folders before anything is written: a file refused there leaves no figure behind.
    Writing into a run folder (by default, an ``out`` inside one, or ``export``) holds its lock, taken before anything
    is read (``rundir.held``): refused while a run trains there.

    Args:
        run_dir: the trained run folder.
        out: a folder to write the figures into; by default RUN/inspect, a real folder of the run
            (``rundir.output_folder``).
        baseline: another run folder (an NCL run), whose gradient conflict is drawn beside the run's.
        export: first (re)write the run's ``gates.nc`` from its checkpoint.
        **load: ``trust_code`` and ``data_dir``, as :func:`~bayesncl_pyro.load_run` takes them.

    Returns:
        The summary lines: the run, its last log record, the gate posterior on the test split, its dimensions'
        class consistency, the figures written.

    Examples:
        >>> lines = inspect(run_dir)  # the figures go to RUN/inspect
        >>> lines[0]  # doctest: +ELLIPSIS
        'run ...: bayesncl on digits, K = 16, 1 log records'
        >>> sorted(p.name for p in (Path(run_dir) / "inspect").glob("*.png"))[:2]
        ['class_heatmap.png', 'elbo.png']
    """
    # each run folder opened once (rundir.RunFolder): its checkpoint, log and conflict records from the same folder
    with held(out if out is not None else run_folder(run_dir) / INSPECT_DIR), \
            held(run_folder(run_dir)) if export else contextlib.nullcontext(), RunFolder.open(run_folder(run_dir)), \
            RunFolder.open(run_folder(baseline)) if baseline is not None else contextlib.nullcontext():
        return _inspect(run_dir, out, baseline, export, **load)


def _inspect(run_dir: Path, out: Path | None, baseline: Path | None, export: bool, **load) -> list[str]:
    """:func:`inspect`, with the run folder's lock held where it writes into it."""
    learner, cfg = load_learner(run_dir, **load)
    log, main = read_log(run_dir), conflict_table(run_dir)
    base = conflict_table(baseline) if main is not None and baseline is not None else None
    base_name = load_learner(baseline, **load)[1].method if baseline is not None else ""
    out = output_folder(out, named=True) if out is not None else output_folder(run_folder(run_dir) / INSPECT_DIR)
    data = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed, holdout=cfg.holdout_cells)
    feats = test_features(learner, data)
    if export:
        if not learner.gated:
            raise UserError(f"{run_dir} is a {cfg.method} run: it has no gates to export")
        from bayesncl_pyro.evaluate.arviz_export import export_gates  # late: arviz is slow to import

        print(f"wrote {export_gates(run_dir, learner, data, test=feats)}")
    summary = [f"run {run_dir}: {cfg.method} on {cfg.dataset}, K = {cfg.proj_dim}, {len(log)} log records"]
    if baseline is not None:
        note = budget_note(cfg.method, trained_steps(run_dir), base_name, trained_steps(baseline))
        summary += [note] if note else []
    if log:
        last = log[-1]
        estimator = gate_class(cfg.gate) if learner.gated else None
        plot_elbo(log, estimator, cfg.kl_weight, out / "elbo.png")
        loss = estimator.loss_name if estimator else "InfoNCE per row"
        summary.append(f"last record (step {last['step']}): {loss} {last['loss']:.4f} = InfoNCE {last['nce']:.4f}"
                       + (f" + lambda * KL {cfg.kl_weight * last['kl']:.2e} (KL {last['kl']:.3f} nats)"
                          if learner.gated else ""))
        warned = [r for r in log if "warnings" in r]
        if warned:
            summary.append(f"degeneracy warnings in {len(warned)} records, first at step {warned[0]['step']}: "
                           + "; ".join(warned[0]["warnings"]))
    features, labels = feats.features, feats.labels
    gated_off = None
    if learner.gated:
        probs = feats.probs
        rate = prior_rate(learner, feats)
        kl = dm.kl_per_dim(probs, rate, cfg.kl_clamp).numpy()
        plot_kl_per_dim(kl, GateEstimator.kl_label(cfg.kl_clamp), out / "kl_per_dim.png")
        plot_inclusion(probs.numpy(), float(rate.mean()), out / "inclusion.png")
        plot_class_heatmap(dm.inclusion_by_class(probs, labels, feats.num_classes)[0].numpy(), data.classes,
                           out / "class_heatmap.png")
        gated_off = dm.mostly_gated(probs).numpy()
        summary += [f"gates on the test split: mean inclusion {probs.mean():.3f}, open in the evaluation mask "
                    f"{feats.mask.mean():.3f}; {int(gated_off.sum())} of {len(gated_off)} dims mostly gated (mean "
                    "inclusion < 0.5)",
                    f"KL per dimension: mean {kl.mean():.4f}, max {kl.max():.4f} nats (dim {int(kl.argmax())})"]
        warning = dm.undecided_warning(probs)
        if warning:
            summary.append(f"warning: {warning}")
    plot_top_images(features, labels, data.test, data.classes, out / "top_images.png")
    summary.append(top_dimensions_line(features, labels, data.classes))
    if main is None:
        summary.append("no conflict records (conflict.jsonl): " + (
            f"the run is shorter than one conflict interval (--conflict-every {cfg.conflict_every} steps)"
            if cfg.conflict_every else "train with --conflict-every N > 0"))
    else:
        if baseline is not None and base is None:  # said, never silently left out
            records = read_conflict(baseline)
            summary.append(f"the baseline {baseline} has {0 if records is None else len(records['step'])} conflict "
                           "record(s), and its conflict needs 2: it is left out of conflict.png and of the lines below "
                           "(train it with --conflict-every at most half its steps)")
        plot_conflict(main, cfg.method, base, base_name, out / "conflict.png")
        summary += conflict_lines(cfg.method, main, gated_off) + (conflict_lines(base_name, base) if base is not None
                                                                  else [])
    atomic_save(("\n".join(summary) + "\n").encode(), out / "summary.txt")
    return summary


def __getattr__(name: str):
    return moved(__name__, name)  # the novelty ROC curves moved to novelty_figures (_deprecated)
