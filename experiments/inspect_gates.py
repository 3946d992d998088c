"""Look at what a run learned: ELBO curves, the gate posterior, class-specific dimensions, the conflict.

    python experiments/inspect_gates.py runs/default                          # a BayesNCL run
    python experiments/inspect_gates.py runs/default --baseline runs/ncl      # conflict next to NCL
    python experiments/inspect_gates.py runs/default --export                 # rewrite gates.nc first

Writes into RUN_DIR/inspect/ (or --out) PNG figures and summary.txt (also printed):

    elbo.png            -ELBO per row and its two terms (InfoNCE, KL) over training
    kl_per_dim.png      KL(q(g_k | x) || p(g_k)) per dimension, averaged over the test images
    inclusion.png       distribution of the inclusion probabilities q(g_k = 1 | x)
    class_heatmap.png   class x dimension mean inclusion, dimensions grouped by the class they prefer
    top_images.png      test images that most activate the most class-consistent dimensions
    conflict.png        the InfoNCE gradient conflict per dimension against its activation frequency

An NCL or CL run gets the figures that need no gates (elbo, top_images, conflict).
"""

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bayesncl_pyro.data import load_dataset  # noqa: E402
from bayesncl_pyro.diagnostics import conflict_scores, read_conflict  # noqa: E402
from bayesncl_pyro.errors import UserError  # noqa: E402
from bayesncl_pyro.guides.gates import Gate, gate_class  # noqa: E402
from bayesncl_pyro.evaluation import extract  # noqa: E402
from bayesncl_pyro.losses import bernoulli_kl  # noqa: E402
from bayesncl_pyro.metrics import dim_consistency  # noqa: E402
from bayesncl_pyro.posterior import gate_posterior  # noqa: E402
from bayesncl_pyro.rundir import load_learner, read_log  # noqa: E402

plt.rcParams.update({"figure.dpi": 110, "font.size": 10, "axes.titlesize": 11, "axes.grid": True,
                     "grid.alpha": 0.3})


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_elbo(log: list[dict], kl_label: str | None, kl_weight: float, path: Path) -> Path:
    """``kl_label``: what the KL term computes (``Gate.kl_label``); None for an ungated method."""
    steps = [r["step"] for r in log]
    panels = [("loss", "-ELBO per row = InfoNCE + lambda * KL"), ("nce", "InfoNCE per row (at the gates training used)")]
    if kl_label:
        panels.append(("kl", f"{kl_label}\nper row, summed over dims (times lambda = {kl_weight:g} in the loss)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4))
    for ax, (key, title) in zip(np.atleast_1d(axes), panels):
        ax.plot(steps, [r[key] for r in log], lw=1.2)
        ax.set(title=title, xlabel="training step", ylabel="nats")
    return _save(fig, path)


def plot_kl_per_dim(kl: np.ndarray, kl_label: str, path: Path) -> Path:
    order = np.argsort(kl)[::-1]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.12 * len(kl)), 3.4))
    ax.bar(np.arange(len(kl)), kl[order], color="tab:purple")
    ax.set(title=f"{kl_label} per dimension,\nmean over test images (sorted; a hierarchical prior at q(rate)'s mean)",
           xlabel="dimension (sorted by KL)", ylabel="KL (nats)")
    _dim_ticks(ax, order)
    return _save(fig, path)


def _dim_ticks(ax, order):
    """Label the bars with dimension ids when there are few enough to read."""
    if len(order) <= 64:
        ax.set_xticks(np.arange(len(order)), [str(k) for k in order], fontsize=6, rotation=90)
        ax.grid(False, axis="x")


def plot_inclusion(probs: np.ndarray, prior_rate: float, path: Path) -> Path:
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
    return _save(fig, path)


def heatmap_order(class_means: np.ndarray) -> np.ndarray:
    """Dimensions grouped by the class they include most, each group sorted by how much more that
    class includes them than the other classes do (most class-specific first)."""
    top = class_means.argmax(0)
    specificity = class_means.max(0) - class_means.mean(0)
    return np.lexsort((-specificity, top))


def plot_class_heatmap(class_means: np.ndarray, classes: list[str], path: Path) -> Path:
    """Top: mean inclusion per class; bottom: the same minus the dimension's mean over classes, where a
    class-specific dimension stands out as one warm cell in a cool column."""
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
    return _save(fig, path)


def _image(item) -> tuple[np.ndarray, str | None]:
    """A dataset image (uint8 C x H x W tensor or PIL image) as an array for imshow, and its colormap."""
    image = item if not torch.is_tensor(item) else item.permute(1, 2, 0).numpy()
    image = np.asarray(image)
    return (image[..., 0], "gray_r") if image.ndim == 3 and image.shape[2] == 1 else (image, None)


def top_dimensions(features: torch.Tensor, labels: torch.Tensor, n: int, min_active: int = 5) -> list[tuple]:
    """The ``n`` most class-consistent dimensions active in at least ``min_active`` test images, as
    (dim, share of its most frequent class, that class, number of active images)."""
    share, counts = dim_consistency(features, labels)
    used = (counts.sum(0) >= min_active).nonzero().flatten().tolist()
    used.sort(key=lambda k: -share[k].item())
    return [(k, share[k].item(), counts[:, k].argmax().item(), int(counts[:, k].sum())) for k in used[:n]]


def plot_top_images(features, labels, dataset, classes, path: Path, dims: int = 8, per_dim: int = 10) -> Path:
    chosen = top_dimensions(features, labels, dims)
    if not chosen:
        raise UserError("no dimension is active in 5 or more test images; the representation has collapsed")
    fig, axes = plt.subplots(len(chosen), per_dim, figsize=(1.05 * per_dim + 1.6, 1.1 * len(chosen) + 0.6),
                             squeeze=False)
    for row, (k, share, cls, active) in enumerate(chosen):
        top = features[:, k].argsort(descending=True)[:per_dim]
        for ax, i in zip(axes[row], top.tolist()):
            image, cmap = _image(dataset[i][0])
            ax.imshow(image, cmap=cmap, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.grid(False)
            ax.set_title(classes[labels[i]], fontsize=8, pad=2)
        axes[row, 0].set_ylabel(f"dim {k}\n{share:.0%} '{classes[cls]}'\n({active} on)", rotation=0,
                                ha="right", va="center", fontsize=8)
    fig.suptitle("test images that most activate the most class-consistent dimensions\n"
                 "(row: dimension, share of its active images in its top class; title: image's class)",
                 fontsize=10)
    return _save(fig, path)


def conflict_table(run_dir: Path) -> dict | None:
    """Per-dimension conflict scores of a run with its mean activation frequency and, for BayesNCL,
    mean inclusion over the logged steps; None if the run logged no conflict records."""
    recs = read_conflict(run_dir)
    if recs is None or len(recs["step"]) < 2:
        return None
    out = conflict_scores(recs["pos"], recs["neg"])
    out["freq"] = recs["freq"].mean(0)
    if "incl" in recs:
        out["incl"] = recs["incl"].mean(0)
    return out


def plot_conflict(main: dict, name: str, baseline: dict | None, baseline_name: str, path: Path) -> Path:
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
        ax.title.set_fontsize(9.5)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.supxlabel("activation frequency of the dimension (share of rows in which it takes part in the loss)",
                  fontsize=10)
    fig.suptitle("InfoNCE gradient conflict, one point per dimension (right: dims shared by most images)",
                 fontsize=11)
    fig.tight_layout()
    if "incl" in main:
        fig.colorbar(sc, ax=axes, label="mean inclusion probability of the dim's gate", fraction=0.02, pad=0.01)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def _median(x, mask=None) -> float:
    x = x if mask is None else x[mask]
    x = x[np.isfinite(x)]
    return float(np.median(x)) if len(x) else float("nan")


def conflict_lines(name: str, t: dict) -> list[str]:
    freq = t["freq"]
    lines = [f"conflict ({name}), medians over dimensions: cancellation {_median(t['cancellation']):.3f}, "
             f"oscillation {_median(t['oscillation']):.3g}, sign flips {_median(t['sign_flips']):.2f}"]
    ok = np.isfinite(t["cancellation"]) & np.isfinite(freq)
    if ok.sum() > 2:
        rank = lambda x: np.argsort(np.argsort(x))  # noqa: E731
        rho = np.corrcoef(rank(freq[ok]), rank(t["cancellation"][ok]))[0, 1]
        lines.append(f"  Spearman(activation frequency, cancellation) = {rho:.2f}")
    if "incl" in t:
        for label, mask in (("mostly open (incl >= 0.5)", t["incl"] >= 0.5), ("mostly gated (incl < 0.5)",
                                                                               t["incl"] < 0.5)):
            lines.append(f"  {label}: {int(mask.sum())} dims, cancellation {_median(t['cancellation'], mask):.3f}, "
                         f"oscillation {_median(t['oscillation'], mask):.3g}, activation {_median(freq, mask):.3f}")
    return lines


def inspect(run_dir: Path, out: Path, baseline: Path | None = None, export: bool = False) -> list[str]:
    """Write the figures of a run into ``out`` and return the summary lines; with ``export``, first (re)write
    the run's ``gates.nc`` from its checkpoint."""
    learner, cfg = load_learner(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed)
    if export:
        if not learner.gated:
            raise UserError(f"{run_dir} is a {cfg.method} run: it has no gates to export")
        from bayesncl_pyro.arviz_export import export_gates  # late: arviz is slow to import

        print(f"wrote {export_gates(run_dir, learner, data)}")
    log = read_log(run_dir)
    kl_label = gate_class(cfg.gate).kl_label(cfg.kl_clamp) if learner.gated else None  # the KL as trained
    summary = [f"run {run_dir}: {cfg.method} on {cfg.dataset}, K = {cfg.proj_dim}, {len(log)} log records"]
    if log:
        last = log[-1]
        plot_elbo(log, kl_label, cfg.kl_weight, out / "elbo.png")
        summary.append(f"last record (step {last['step']}): -ELBO/row {last['loss']:.4f} = InfoNCE {last['nce']:.4f}"
                       + (f" + lambda * KL {cfg.kl_weight * last['kl']:.2e} (KL {last['kl']:.3f} nats)"
                          if learner.gated else ""))
        warned = [r for r in log if "warnings" in r]
        if warned:
            summary.append(f"degeneracy warnings in {len(warned)} records, first at step {warned[0]['step']}: "
                           + "; ".join(warned[0]["warnings"]))
    if learner.gated:
        post = gate_posterior(learner, data)
        features, labels, probs = post.features, post.labels, post.probs.numpy()
        rate = learner.model.prior.mean_rate(learner.guide.rate_guide)  # of q(rate), for a hierarchical prior
        kl = bernoulli_kl(post.probs, rate, cfg.kl_clamp).mean(0).numpy()
        plot_kl_per_dim(kl, Gate.kl_label(cfg.kl_clamp), out / "kl_per_dim.png")  # at q's own probabilities
        plot_inclusion(probs, float(rate.mean()), out / "inclusion.png")
        plot_class_heatmap(post.class_means.numpy(), data.classes, out / "class_heatmap.png")
        mean_incl = probs.mean(0)
        summary += [f"gates: mean inclusion {probs.mean():.3f}, open (q > 0.5) {(probs > 0.5).mean():.3f}; "
                    f"{int((mean_incl < 0.5).sum())} of {len(mean_incl)} dims mostly gated off",
                    f"KL per dimension: mean {kl.mean():.4f}, max {kl.max():.4f} nats (dim {int(kl.argmax())})"]
    else:
        _, features, labels = extract(learner, data.test, cfg, data.channels, "cpu")
    plot_top_images(features, labels, data.test, data.classes, out / "top_images.png")
    summary.append("most class-consistent dims: " + ", ".join(
        f"{k} ({share:.0%} '{data.classes[c]}', {n} on)" for k, share, c, n in top_dimensions(features, labels, 8)))
    main = conflict_table(run_dir)
    if main is None:
        summary.append("no conflict records (conflict.jsonl): " + (
            f"the run is shorter than one conflict interval (--conflict-every {cfg.conflict_every} steps)"
            if cfg.conflict_every else "train with --conflict-every N > 0"))
    else:
        base = conflict_table(baseline) if baseline is not None else None
        base_name = load_learner(baseline)[1].method if baseline is not None else ""
        plot_conflict(main, cfg.method, base, base_name, out / "conflict.png")
        summary += conflict_lines(cfg.method, main) + (conflict_lines(base_name, base) if base is not None else [])
    (out / "summary.txt").write_text("\n".join(summary) + "\n")
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="a run folder written by run_svi.py")
    p.add_argument("--baseline", type=Path, help="another run folder (e.g. NCL) drawn next to it in conflict.png")
    p.add_argument("--out", type=Path, help="where the figures go (default: RUN_DIR/inspect)")
    p.add_argument("--export", action="store_true", help="first (re)write RUN_DIR/gates.nc, the gate posterior as "
                   "ArviZ data, from the checkpoint (after a run whose export failed)")
    args = p.parse_args(argv)
    try:
        summary = inspect(args.run_dir, args.out or args.run_dir / "inspect", args.baseline, args.export)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
