"""DCI disentanglement and completeness of a representation against known factors (Eastwood and Williams, 2018).

As disentanglement_lib computes them (``disentanglement_lib/evaluation/metrics/dci.py``): an importance matrix R
(K codes x M factors) from one predictor per factor, each column R[:, j] the absolute feature importances of a
gradient-boosted tree classifier (scikit-learn's ``GradientBoostingClassifier`` at its defaults, as the library's
``compute_importance_gbt``) that predicts factor j from the K codes; then

* disentanglement: per code k, D_k = 1 - H_M(P_k.), P_k. = R[k, :] / sum_j R[k, j], H_M the entropy in base M;
  D = sum_k rho_k D_k with rho_k = sum_j R[k, j] / sum R (a code that predicts nothing weighs nothing);
* completeness: per factor j, C_j = 1 - H_K(P_.j), P_.j = R[:, j] / sum_k R[k, j], in base K;
  C = sum_j w_j C_j with w_j = sum_k R[k, j] / sum R.

D is 1 when every code that matters predicts one factor only; C is 1 when each factor is predicted by one code only.
As the library does, each predictor is fitted on one half of the samples (the "train" points) and its accuracy on the
other half is the informativeness; the importances are the fitted model's.
"""

import numpy as np
import torch

ENTROPY_FLOOR = 1e-11
"""Added to R before its entropies, as disentanglement_lib does, so that an all-zero row or column is defined (it is
then uniform, and weighs nothing)."""


def disentanglement(importance: np.ndarray) -> float:
    """D of a K x M importance matrix: the codes' 1 - entropy over factors (base M), weighted by their importance."""
    from scipy import stats  # late: scipy's import costs a second, and only a run with known factors needs it

    per_code = 1.0 - stats.entropy(importance.T + ENTROPY_FLOOR, base=importance.shape[1])
    weights = importance if importance.sum() > 0 else np.ones_like(importance)
    return float(np.sum(per_code * weights.sum(axis=1) / weights.sum()))


def completeness(importance: np.ndarray) -> float:
    """C of a K x M importance matrix: the factors' 1 - entropy over codes (base K), weighted by their importance."""
    from scipy import stats  # late: as in disentanglement

    per_factor = 1.0 - stats.entropy(importance + ENTROPY_FLOOR, base=importance.shape[0])
    weights = importance if importance.sum() > 0 else np.ones_like(importance)
    return float(np.sum(per_factor * weights.sum(axis=0) / weights.sum()))


def importance_matrix(codes: np.ndarray, factors: np.ndarray, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """K x M importances and M informativeness accuracies of N x K ``codes`` for N x M discrete ``factors``.

    One ``GradientBoostingClassifier`` per factor (``random_state=seed``), fitted on a random half of the samples (a
    permutation drawn from ``seed``: an even/odd split would be random only where the samples' order is); its
    ``feature_importances_`` are the factor's column, its accuracy on the other half its informativeness. A factor with
    one value in the fitted half has nothing to predict: its column is zero and its accuracy 1.

    Read D with care where a factor is predicted near chance: gradient-boosted importances of a classifier that has
    learnt nothing still concentrate on a few codes (fitted noise), which gives a disentanglement near 0.7 for a class
    predictor at chance, so a gap in D between runs whose class informativeness is 31-40 % is weak evidence.
    """
    from sklearn.ensemble import GradientBoostingClassifier  # late: as scipy's, for a run with known factors only

    order = np.random.default_rng(seed).permutation(len(codes))
    train, test = order[: len(codes) // 2], order[len(codes) // 2:]
    importance = np.zeros((codes.shape[1], factors.shape[1]))
    accuracy = np.ones(factors.shape[1])
    for j in range(factors.shape[1]):
        if len(np.unique(factors[train, j])) < 2:
            continue
        model = GradientBoostingClassifier(random_state=seed).fit(codes[train], factors[train, j])
        importance[:, j] = np.abs(model.feature_importances_)
        accuracy[j] = model.score(codes[test], factors[test, j])
    return importance, accuracy


def dci(features: torch.Tensor, factors: dict[str, torch.Tensor], seed: int = 0) -> dict:
    """eval.json's DCI keys of N x K ``features`` against ``factors`` ({name: N long}).

    ``dci_disentanglement``, ``dci_completeness``, and ``dci_informativeness_<name>`` per factor (held-out accuracy of
    its predictor, :func:`importance_matrix`).
    """
    names = list(factors)
    r, accuracy = importance_matrix(features.double().cpu().numpy(),
                                    torch.stack([factors[n] for n in names], dim=1).cpu().numpy(), seed)
    return dict(dci_disentanglement=disentanglement(r), dci_completeness=completeness(r),
                **{f"dci_informativeness_{n}": float(a) for n, a in zip(names, accuracy)})
