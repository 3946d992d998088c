"""Per-dimension numbers of a run's representation on the test split, shared by the report and the figures.

``bayesncl_pyro/evaluate/report_data.py`` (the HTML report's numbers) and ``experiments/inspect_gates.py`` (the
figures) both read them here, so that a number in a figure and in the report cannot differ. They read the test split's
features, which ``evaluate/heldout.py`` computes in one pass of the backbone for the evaluation too:

    feats = test_features(learner, data)        # F and, for BayesNCL, the ungated features, q(g = 1 | x), the mask
    ranked = Ranking(feats.features)             # every dimension's test images by activation, largest first
    ranked.top(dims, 12)                         # len(dims) x 12 image indices, -1 past the dim's active images

N test images, K dimensions, C classes throughout. An entry is *active* when it exceeds ``nn.losses.ACTIVE_EPS`` in
the L2-normalised row (``metrics.active_entries``, as the metrics count it); a dimension is *in use* when its
column is not all zero (``metrics.alive``: eval.json's ``active_dims`` counts these). A dimension's *support* is
the number of test images in which it is active. The gate posterior on the same split, and the prior's rate the KL per
dimension is taken against, are ``evaluate/posterior.py``'s.
"""

import torch
import torch.nn.functional as F

from bayesncl_pyro._deprecated import moved
from bayesncl_pyro.evaluate import keys
from bayesncl_pyro.evaluate.heldout import TestFeatures
from bayesncl_pyro.evaluate.metrics import (
    active_entries,
    alive,
    closed_share,
    dim_consistency,
    factor_information,
    nearest_neighbours,
    top_class_share,
    tracked_factors,
)
from bayesncl_pyro.nn.losses import ACTIVE_EPS, bernoulli_kl

QUANTILES = tuple((j + 0.5) / 10 for j in range(10))
"""The activation quantiles (0.05, 0.15, ..., 0.95) at which a dimension's active images are shown."""

UNDECIDED = 0.1
"""An inclusion probability within this of 0.5 is undecided: the mask 1[q > 0.5] is then the sign of a near-zero
logit, and a draw from q flips it nearly half of the time."""


def min_support(num_images: int, num_classes: int) -> int:
    """The fewest active test images for a dimension to be ranked by class consistency.

    A quarter of an average class's test images, and at least 10 (a dimension that fires on 6 images is consistent by
    chance).
    """
    return max(10, num_images // (4 * num_classes))


def support(features: torch.Tensor) -> torch.Tensor:
    """K: the number of test images in which each dimension is active."""
    return active_entries(features).sum(0).long()


def class_counts(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """C x K: per class, the number of its images in which each dimension is active.

    The class histogram of a dimension's active images: ``metrics.dim_consistency``'s, padded to every class.
    """
    counts = dim_consistency(features, labels)[1].long()
    return F.pad(counts, (0, 0, 0, num_classes - len(counts)))


def consistency(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(share, dominant class), K each, from :func:`class_counts`.

    The share of a dimension's active images that belong to its most frequent class (``metrics.top_class_share``, as
    ``metrics.semantic_consistency`` averages it), and that class.
    """
    return top_class_share(counts), counts.argmax(0)


def consistent_dims(features: torch.Tensor, labels: torch.Tensor, num_classes: int, n: int,
                    least: int | None = None) -> list[int]:
    """The ``n`` most class-consistent dimensions, most consistent first.

    Only dimensions active in at least ``least`` test images (default: :func:`min_support`) are ranked.
    """
    least = min_support(len(labels), num_classes) if least is None else least
    share, _ = consistency(class_counts(features, labels, num_classes))
    ok = (support(features) >= least).nonzero().flatten()
    return ok[share[ok].argsort(descending=True, stable=True)][:n].tolist()


def inclusion_by_class(probs: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """(mean, sd), C x K each: q(g_k = 1 | x) averaged over the test images of each class.

    sd is its standard deviation over those images (0 for a class with no image).
    """
    one_hot = F.one_hot(labels, num_classes).to(probs.dtype)
    n = one_hot.sum(0).clamp_min(1)[:, None]
    mean = one_hot.T @ probs / n
    var = (one_hot.T @ probs.square() / n - mean.square()).clamp_min(0)
    return mean, var.sqrt()


class Ranking:
    """Every dimension's test images by a value (an N x K activation), largest first.

    Only entries above ``ACTIVE_EPS`` count (the rest are the dimension's inactive images).
    """

    def __init__(self, values: torch.Tensor):
        # K x N, each dimension's images sorted by value (rows of a contiguous transpose sort fastest)
        self.order = values.T.contiguous().sort(dim=1, descending=True, stable=True).indices
        self.count = (values > ACTIVE_EPS).sum(0)  # K: a dimension's images with a positive activation

    def top(self, dims: torch.Tensor, k: int) -> torch.Tensor:
        """len(dims) x k image indices: each dimension's k images of largest value, -1 past its active ones."""
        k = min(k, self.order.shape[1])
        return torch.where(torch.arange(k) < self.count[dims, None], self.order[dims, :k], -1)

    def at_quantiles(self, dims: torch.Tensor, quantiles=QUANTILES) -> torch.Tensor:
        """len(dims) x len(quantiles) image indices: per dimension, its active image at each quantile.

        Among a dimension's active images in ascending order of value, the one at each quantile (nearest rank); -1 for a
        dimension active in no image.
        """
        n = self.count[dims, None]  # D x 1
        q = torch.tensor(quantiles, dtype=torch.float64)
        from_top = (n - 1 - (q * (n - 1)).round().long()).clamp_min(0)  # D x Q positions in self.order's rows
        idx = self.order[dims[:, None], from_top]
        return torch.where(n > 0, idx, -1)


def histograms(values: torch.Tensor, bins: int, high: torch.Tensor | float = 1.0,
               where: torch.Tensor | None = None) -> torch.Tensor:
    """K x bins counts of each column of ``values`` (N x K) over [0, high].

    ``high``: a number or K maxima; values at ``high`` fall in the last bin. Only the entries where ``where`` (N x K
    bool) holds are counted.
    """
    high = torch.as_tensor(high, dtype=values.dtype).clamp_min(torch.finfo(values.dtype).tiny)
    b = (values / high * bins).floor().long().clamp(0, bins - 1)
    b = b + bins * torch.arange(values.shape[1])  # one range of bins per column: a single bincount
    if where is not None:
        b = b[where]
    return torch.bincount(b.flatten(), minlength=values.shape[1] * bins).view(values.shape[1], bins)


def _standardised(features: torch.Tensor, dims: torch.Tensor) -> torch.Tensor:
    """N x len(dims): the columns of F, centred and scaled to unit norm (dot products are Pearson's r)."""
    x = features[:, dims].float()
    x = x - x.mean(0)
    return x / x.norm(dim=0).clamp_min(1e-12)


def correlated_dims(features: torch.Tensor, dims: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dims, r), len(dims) x n each: for each of ``dims``, the n others whose columns of F correlate most with it.

    Pearson r over the test images, most correlated first; the others are drawn from ``dims``.
    """
    x = _standardised(features, dims)
    r = x.T @ x
    r.fill_diagonal_(-torch.inf)
    best = r.topk(min(n, len(dims) - 1), dim=1)
    return dims[best.indices], best.values


def closest_dims(features: torch.Tensor, dims: torch.Tensor, other: torch.Tensor,
                 other_dims: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dim, r), len(dims) each: for each of ``dims``, the closest dimension of another representation.

    For each of ``dims`` of F, the one of ``other_dims`` of another representation of the same test images (a baseline
    run's) whose column correlates most with it, and Pearson's r.
    """
    r = _standardised(features, dims).T @ _standardised(other, other_dims)
    best = r.max(dim=1)
    return other_dims[best.indices], best.values


def neighbours(features: torch.Tensor, n: int) -> torch.Tensor:
    """N x n: each test image's nearest other test images, nearest first.

    By cosine similarity of its row of ``features`` (``metrics.nearest_neighbours``, as retrieval precision ranks them).
    """
    return nearest_neighbours(F.normalize(features.float(), dim=1), min(n, len(features) - 1))


def mask_flip_share(probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """N: the expected share of each image's K gates that a draw from q(g | x) sets otherwise than its mask.

    mean_k |mask_k - q(g_k = 1 | x)|: how stable each image's evaluation mask is under draws. Exact, for q(g | x) a
    product of Bernoullis; 0 for a mask that every draw reproduces, about 0.5 for undecided gates.
    """
    return (mask.to(probs) - probs).abs().mean(1)


def mostly_gated(probs: torch.Tensor) -> torch.Tensor:
    """K bool: the dimensions whose mean inclusion probability over the test images is below 0.5."""
    return probs.mean(0) < 0.5


def undecided_share(probs: torch.Tensor) -> float:
    """The share of (image, dimension) inclusion probabilities within ``UNDECIDED`` of 0.5."""
    return float(((probs - 0.5).abs() < UNDECIDED).double().mean())


def undecided_warning(probs: torch.Tensor) -> str | None:
    """A warning when the gates never left 0.5, else None.

    "Never left": 90 % or more of the test split's inclusion probabilities within ``UNDECIDED`` of 0.5.
    """
    share = undecided_share(probs)
    if share < 0.9:
        return None
    return (f"the gates never left 0.5: {share:.0%} of the test split's q(g = 1 | x) lie within {UNDECIDED} of it "
            f"(mean {probs.mean():.2f} +- {probs.std():.2f}), so the mask is a coin flip on near-zero logits and says "
            "nothing about the images yet; train for more steps before reading the gates")


def kl_per_dim(probs: torch.Tensor, rate: torch.Tensor, kl_clamp: float) -> torch.Tensor:
    """K: the KL per dimension at q's inclusion probabilities, averaged over the test images.

    This is ``GateEstimator``'s KL term, KL(q(g_k | x) || Bernoulli(rate_k)) with both rates clamped to [kl_clamp,
    1 - kl_clamp], for every run: also for ``gs-reference-kl``, which trains another. Its label is
    ``GateEstimator.kl_label(kl_clamp)``.
    """
    return bernoulli_kl(probs, rate, kl_clamp).mean(0)


def factor_scores(feats: TestFeatures) -> dict[str, dict[str, torch.Tensor]]:
    """For generated data, per ground-truth factor: which dimensions carry it, with the gates and without.

    ``information`` (K, ``metrics.factor_information`` of F) and ``tracks`` (K bool, ``metrics.factor_tracking``),
    and for a gated run the same of the ungated features (``information_ungated``, ``tracks_ungated``); eval.json's
    ``dims_tracking_*`` counts the ``tracks``.
    """
    out = {name: {} for name in feats.factors}
    for r, features in [(keys.F, feats.features)] + ([(keys.UNGATED, feats.ungated)] if feats.gated else []):
        information = {name: factor_information(features, v) for name, v in feats.factors.items()}
        for name, mask in tracked_factors(information).items():
            out[name].update({keys.format("information", r): information[name], keys.format("tracks", r): mask})
    return out


def gates_closed(feats: TestFeatures) -> torch.Tensor:
    """K: per dimension, the share of the test images where its ungated feature is active whose gate is closed.

    ``metrics.closed_share``; eval.json's ``gated_off_dims_*`` counts the tracking dims above 0.5.
    """
    return closed_share(feats.ungated, feats.mask)


def in_use(features: torch.Tensor) -> torch.Tensor:
    """The dimensions in use (``metrics.alive``), as indices."""
    return alive(features).nonzero().flatten()


def __getattr__(name: str):
    return moved(__name__, name)  # the gate posterior moved to evaluate/posterior (_deprecated)
