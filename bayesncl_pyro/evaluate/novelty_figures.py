"""The novelty scores' ROC curves (experiments/novelty.py's RUN/novelty-roc.png), in the style of a run's figures."""

from pathlib import Path

import numpy as np
import torch

from bayesncl_pyro.evaluate.figures import plt, save

ROC_SCORES = ("kl_prior", "gate_entropy", "bald", "weight_mi", "control_kl0_kl_prior", "control_ensemble_mi",
              "knn_backbone", "mahalanobis_backbone", "msp_backbone", "topk_atypicality")
"""The novelty scores whose ROC curves are drawn (those the run has): the posterior's, the controls' and the strongest
deterministic baselines."""


def plot_roc(in_scores: dict[str, torch.Tensor], novel: dict[str, dict[str, torch.Tensor]], kinds: dict[str, str],
             path: Path) -> Path:
    """One panel per novel set: each of ``ROC_SCORES``' ROC curve against the in-distribution images, in ``path``.

    Posterior scores are solid, the controls dashed and the deterministic ones dotted; a nuisance set's panel says that
    a curve near the diagonal is what a score that follows the class should draw there.
    """
    from sklearn.metrics import roc_curve  # late: only this figure needs it

    names = [n for n in ROC_SCORES if n in in_scores]
    fig, axes = plt.subplots(1, len(novel), figsize=(3.6 * len(novel), 3.8), squeeze=False)
    for ax, (name, scores) in zip(axes[0], novel.items()):
        for score in names:
            known, new = in_scores[score].numpy(), scores[score].numpy()
            labels = np.r_[np.zeros(len(known)), np.ones(len(new))]
            if not np.isfinite(np.r_[known, new]).all():
                continue
            fpr, tpr, _ = roc_curve(labels, np.r_[known, new])
            style = "-" if not score.startswith(("control", "knn", "mahal", "msp", "topk")) else \
                "--" if score.startswith("control") else ":"
            ax.plot(fpr, tpr, style, label=score, lw=1.4)
        ax.plot([0, 1], [0, 1], color="0.6", lw=0.8)
        kind = kinds.get(name, "semantic")
        ax.set_title(f"{name} ({kind}{': should stay near the diagonal' if kind == 'nuisance' else ''})", fontsize=9)
        ax.set_xlabel("in-distribution flagged (FPR)")
    axes[0][0].set_ylabel("novel flagged (TPR)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    return save(fig, path)
