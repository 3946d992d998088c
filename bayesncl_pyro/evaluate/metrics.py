"""Interpretability and retrieval metrics of a representation, as the reference computes them.

Every function takes ``features``, an N x K float tensor F (the representation the method is judged
on: normalise(relu(z)) for NCL, the gated version for BayesNCL, normalise(z) for CL) and, where
classes matter, ``labels``, an N long tensor. They return python floats (fractions, not percent).

A dimension is *active* in a sample when |F| > ``ACTIVE_EPS``; a dimension is *alive* when its
column of |F| sums to more than zero. Degenerate inputs (all-zero features, so no alive dimension)
give 0.0 for every per-dimension average rather than NaN, so a collapsed run still logs numbers.
"""

import math

import torch
import torch.nn.functional as F

from bayesncl_pyro.nn.losses import ACTIVE_EPS

_CHUNK_ROWS = 1024
"""Query rows per similarity block: 1024 x 10,000 floats is 40 MB."""


def alive(features):
    """K bool mask of the dimensions in use: those whose column of |F| sums to more than zero."""
    return features.abs().sum(dim=0) > 0


def active_entries(features):
    """N x K 0/1 (double): entry active once rows are L2-normalised, which makes ACTIVE_EPS scale-free."""
    return (F.normalize(features.double(), dim=1).abs() > ACTIVE_EPS).double()


def _class_mass(weights, labels):
    """C x K per-class column sums of ``weights`` (N x K), C = labels.max() + 1."""
    one_hot = F.one_hot(labels, int(labels.max()) + 1).to(weights.dtype)
    return one_hot.T @ weights


def _mean_over_used_dims(mass, per_dim):
    """Average ``per_dim`` (K) over the dims whose class mass (C x K) is non-zero; 0.0 if none."""
    used = mass.sum(dim=0) > 0
    return float(per_dim[used].mean()) if used.any() else 0.0


def semantic_consistency(features, labels):
    """The paper's semantic consistency of N x K features.

    The mean over dims of the share of the most frequent class among the samples active in that dim.

    features: N x K, labels: N. Rows are L2-normalised first (as in the reference) so the 1e-5
    threshold is scale-free. Dense features give exactly the largest class share, i.e. 1/C for
    balanced labels; one dimension per class gives 1.0. Dims active in no sample are skipped.

    It rewards sparsity itself: a dim active in few samples has its top class cover many of them whatever it
    responds to (a class-blind dim on 8 balanced classes scores 1.0 when it fires in one sample, about 0.30 in ten),
    and dropping a dim of low consistency is never penalised. :func:`topn_consistency` is the reading sparsity
    cannot game.
    """
    share, counts = dim_consistency(features, labels)
    return _mean_over_used_dims(counts, share)


def dim_consistency(features, labels):
    """Per dim, the top class's share of its active samples, and the class counts.

    Returns (share, counts): per dim (K) the share of the most frequent class among the samples active in it
    (:func:`top_class_share`), and the C x K counts of active samples per class. features: N x K, labels: N.
    """
    counts = _class_mass(active_entries(features), labels)
    return top_class_share(counts), counts


def top_class_share(counts):
    """Per dim, the share of its active samples that its most frequent class holds.

    K values from the C x K ``counts`` (active samples per class); 0 where it has none. In the dtype of ``counts`` (a
    float one for an integer one).
    """
    return counts.max(dim=0).values / counts.sum(dim=0).clamp_min(1)


TOPN_SHARE, TOPN_MIN = 0.01, 20
"""The top-N consistency's N: 1 % of the test split, and at least 20 samples."""
CHANCE_DRAWS = 2000
"""Random N-subsets of the labels that :func:`topn_chance` averages over."""


def topn_size(num_samples: int) -> int:
    """N of :func:`topn_consistency` for a test split of ``num_samples``: 1 % of it, at least 20."""
    return max(TOPN_MIN, math.ceil(TOPN_SHARE * num_samples))


def topn_consistency(features, labels, n: int | None = None) -> dict:
    """A consistency that sparsity cannot game, judged on each dim's top ``n`` samples.

    Per dim, the share of the most frequent class among its ``n`` samples of largest value (rows L2-normalised first),
    averaged over the dims active in at least ``n`` samples.

    features: N x K, labels: N; n: :func:`topn_size` of N when None. Every dim is judged on the same number of
    samples, so a class-blind dim scores :func:`topn_chance` however rarely it fires, and one that fires in fewer
    than ``n`` samples is not judged at it all; how much of the representation was judged is the coverage. Ranking
    by value reads magnitudes, so soft gating (features scaled by a probability) changes it. Ties in value are
    broken by sample index. Returns ``semantic_consistency_topn`` (0.0 when no dim qualifies),
    ``topn_coverage_dims`` (the qualifying dims) and ``topn_coverage_images`` (the share of samples active in at
    least one of them).
    """
    n = topn_size(len(labels)) if n is None else n
    values = F.normalize(features.double(), dim=1).abs()
    active = values > ACTIVE_EPS
    qualifying = active.sum(dim=0) >= n
    if not qualifying.any():
        return dict(semantic_consistency_topn=0.0, topn_coverage_dims=0, topn_coverage_images=0.0)
    top = values[:, qualifying].sort(dim=0, descending=True, stable=True).indices[:n]  # n x K' sample indices
    counts = F.one_hot(labels[top], int(labels.max()) + 1).sum(dim=0)  # K' x C
    return dict(semantic_consistency_topn=float((counts.max(dim=1).values / n).double().mean()),
                topn_coverage_dims=int(qualifying.sum()),
                topn_coverage_images=float(active[:, qualifying].any(dim=1).double().mean()))


def topn_chance(labels, n: int | None = None, seed: int = 0) -> float:
    """The top-N consistency of a class-blind dim, estimated by sampling.

    The expected share of the most frequent class among ``n`` samples drawn at random without replacement from
    ``labels`` (N), estimated from :data:`CHANCE_DRAWS` seeded draws (standard error below 0.002 for N = 20 on 8
    classes). n: :func:`topn_size` of N when None.
    """
    n = topn_size(len(labels)) if n is None else n
    g = torch.Generator().manual_seed(seed)
    picks = torch.rand(CHANCE_DRAWS, len(labels), generator=g).argsort(dim=1)[:, :n]
    counts = F.one_hot(labels[picks], int(labels.max()) + 1).sum(dim=1)  # draws x C
    return float((counts.max(dim=1).values / n).double().mean())


def semantic_entropy(features, labels, weighting="magnitude"):
    """Mean over dims of the entropy (nats) of the class distribution a dim responds to.

    features: N x K, labels: N. weighting="magnitude": p_c proportional to the summed |F| of
    class c in that dim; "frequency": to the number of class-c samples active in it. Lower means
    each dim is tied to fewer classes. Dims with no mass are skipped.
    """
    magnitude = features.double().abs()
    if weighting == "magnitude":
        weights = magnitude
    elif weighting == "frequency":
        weights = (magnitude > ACTIVE_EPS).double()
    else:
        raise ValueError(f"weighting must be 'magnitude' or 'frequency', got {weighting!r}")
    mass = _class_mass(weights, labels)
    p = mass / mass.sum(dim=0).clamp_min(torch.finfo(mass.dtype).tiny)
    entropy = -torch.special.xlogy(p, p).sum(dim=0)  # xlogy: 0 log 0 = 0
    return _mean_over_used_dims(mass, entropy)


def sparsity(features):
    """Fraction of the N x K entries with |F| <= ACTIVE_EPS (dead dims count as sparse)."""
    return float((features.abs() <= ACTIVE_EPS).double().mean())


def active_dims(features):
    """Number of the K dims with non-zero mean |F| over the N samples."""
    return int(alive(features).sum())


def activation_rate(features):
    """Mean over alive dims of the fraction of the N samples in which the dim is active.

    Unlike 1 - sparsity, dead dims are left out, so this measures how selective the dims that are
    used are, not how many dims are used. 0.0 when no dim is alive.
    """
    used = alive(features)
    if not used.any():
        return 0.0
    return float((features[:, used].abs() > ACTIVE_EPS).double().mean())


def effective_rank(features):
    """Entropy (nats) of the singular values of the N x K features, normalised to sum to one.

    As in the reference this is *not* exponentiated: rank 1 gives 0, K equal singular values give
    log K. 0.0 for all-zero features.
    """
    singular = torch.linalg.svdvals(features.double())
    total = singular.sum()
    if total <= 0:
        return 0.0
    p = singular / total
    return float(-torch.special.xlogy(p, p).sum())


def rankme(features):
    """RankMe: a smooth count of the directions the features use.

    RankMe (Garrido et al., 2023) is exp of :func:`effective_rank`, a smooth count of the directions the N x K features
    use, from 1 (rank one) to min(N, K) (equal singular values). 1.0 for all-zero features.
    """
    return math.exp(effective_rank(features))


def orthogonality(features):
    """Mean |C - I| over the k x k cosine Gram matrix C of the k alive columns of N x K features.

    0 for mutually orthogonal dims; the diagonal (always 1 - 1) is included in the mean, as in the
    reference. 0.0 when no dim is alive.
    """
    used = alive(features)
    if not used.any():
        return 0.0
    columns = F.normalize(features[:, used].double(), dim=0)
    gram = columns.T @ columns
    return float((gram - torch.eye(len(gram), dtype=gram.dtype)).abs().mean())


def retrieval_precision(features, labels, ks=(1, 3, 5, 10), num_dims=None):
    """Precision@k of cosine nearest-neighbour retrieval on the strongest dims, for each k in ks.

    features: N x K, labels: N. Keeps the ``num_dims`` dims with the largest column sum of |F| (None: all alive dims;
    the reference protocol keeps 512, ``evaluation.protocol``), re-normalises rows, and for each query takes its
    top-max(ks) cosine neighbours among the *other* N - 1 samples (excluded by index, so duplicates of the query still
    count as neighbours). P@k is the mean fraction of the first k neighbours that share the query's label. Returns {k:
    P@k}.
    """
    if max(ks) > len(features) - 1:
        raise ValueError(f"max(ks)={max(ks)} needs at least {max(ks) + 1} samples, got {len(features)}")
    column_mass = features.abs().sum(dim=0)
    keep = int(alive(features).sum()) if num_dims is None else min(num_dims, features.shape[1])
    dims = column_mass.topk(keep).indices
    reduced = F.normalize(features[:, dims].float(), dim=1)

    neighbours = nearest_neighbours(reduced, max(ks))
    hits = (labels[neighbours] == labels[:, None]).double()  # N x max(ks): neighbour j of query i shares its label
    return {k: float(hits[:, :k].mean()) for k in ks}


def nearest_neighbours(rows, k):
    """Indices of each row's k nearest other rows by dot product.

    N x k, nearest first (cosine for L2-normalised rows); the row itself is excluded by index, so a duplicate of it
    still counts. rows: N x K.
    """
    out = []
    for chunk in torch.arange(len(rows)).split(_CHUNK_ROWS):
        sims = rows[chunk] @ rows.T
        sims[torch.arange(len(chunk)), chunk] = -math.inf
        out.append(sims.topk(k, dim=1).indices)
    return torch.cat(out)


def _binary_entropy(p):
    return -torch.special.xlogy(p, p) - torch.special.xlogy(1 - p, 1 - p)


def factor_information(features, factor):
    """Per dim (K, in [0, 1]), the share of its on/off entropy that ``factor`` explains beyond chance.

    features: N x K, factor: N long (a ground-truth factor's value per sample). With a_k = 1[|F_k| >
    ACTIVE_EPS] (rows L2-normalised first), returns (I(a_k; factor) - (V - 1) / 2N) / H(a_k), V the number of
    factor values seen: 1 when the dim is on exactly for some set of factor values (up to the correction), 0 when
    it is independent of the factor. The plug-in information of N samples exceeds the true one by (V - 1) / 2N
    nats on average (Miller-Madow), which is subtracted: uncorrected, a dim that fires in 4 of 1,280 images
    independently of an 8-valued class scores at least 0.1, the share of a dim that tracks it, because its
    entropy, the denominator, is as small as that bias. With the correction, scores of factors with different
    numbers of values stay comparable for dims that fire rarely too. Dims that are always or never on score 0.
    """
    active = active_entries(features)
    one_hot = F.one_hot(factor).double()  # N x V
    counts = one_hot.sum(dim=0)
    p_value = counts / len(factor)  # V
    p_on_given = (one_hot.T @ active) / counts[:, None].clamp_min(1)  # V x K
    h_on = _binary_entropy(active.mean(dim=0))
    information = h_on - p_value @ _binary_entropy(p_on_given) - (int((counts > 0).sum()) - 1) / (2 * len(factor))
    score = information / h_on.clamp_min(torch.finfo(h_on.dtype).tiny)
    return torch.where(h_on > 1e-12, score, 0.0).clamp(0, 1)


def closed_share(ungated, gates):
    """Per dim, the share of its active ungated entries whose gate is closed.

    K values, 0 for a dim active in none. ungated: N x K features before gating; gates: N x K 0/1, the gates the
    representation uses.
    """
    active = (ungated.abs() > ACTIVE_EPS).double()
    return ((1 - gates.double()) * active).sum(0) / active.sum(0).clamp_min(1)


def factor_tracking(features, factors, min_score=0.1):
    """Which ground-truth factor each dim tracks: ``{name: K bool mask}``.

    features: N x K, factors: ``{name: N long}``. :func:`tracked_factors` of each factor's
    :func:`factor_information`.
    """
    return tracked_factors({n: factor_information(features, v) for n, v in factors.items()}, min_score)


def tracked_factors(information, min_score=0.1):
    """Which factor each dim tracks, from ``{name: K scores}`` (:func:`factor_information`): ``{name: K bool mask}``.

    A dim tracks the factor of largest score if that score is at least ``min_score``; each dim is in at most one
    mask (ties go to the factor listed first).
    """
    names = list(information)
    scores = torch.stack([information[n] for n in names])  # factors x K
    best, which = scores.max(dim=0)
    return {n: (which == i) & (best >= min_score) for i, n in enumerate(names)}


def interpretability_metrics(features, labels):
    """All interpretability metrics of N x K features, as one dict.

    Label-aware and label-free: the paper's (semantic consistency and entropy, ...) and the top-N consistency with its
    coverage (:func:`topn_consistency`).
    """
    return {
        "semantic_consistency": semantic_consistency(features, labels),
        **topn_consistency(features, labels),
        "semantic_entropy": semantic_entropy(features, labels),
        "activation_rate": activation_rate(features),
        "active_dims": active_dims(features),
        "sparsity": sparsity(features),
        "effective_rank": effective_rank(features),
        "orthogonality": orthogonality(features),
    }
