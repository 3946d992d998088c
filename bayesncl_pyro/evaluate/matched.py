"""Is a gate's gain more than sparsity? The baselines that answer it, and the representations of a gated run.

Semantic consistency rises as a representation gets sparser, whatever selects the entries that stay: a dimension
that fires on fewer images has its top class cover more of them. So a gated run is judged beside

* the same run's ungated features under *random* masks that keep as many active entries as its representation F
  has (:func:`random_mask_null`): the same encoder and the same sparsity, without the gates' selection;
* NCL+TopK of the same seed at the same activation rate or sparsity (``pairing.topk_at_rate``, in ``compare.py``'s
  tables): another way to be that sparse, trained as such;

and, since an ELBO-trained q near its prior has a mode that summarises it badly, at the posterior mean (the paper's
"soft gating", normalise(u * p)) and averaged over draws of g ~ q(g | x) (:func:`posterior_representations`).

The random-mask null matches F's sparsity in expectation only and keeps every dim of u alive; the controls of
:func:`count_matched_controls` match it image by image: u keeping each image's largest entries (a TopK chosen after
training), and random entries of the image, among all of u's dims or only those F uses (:data:`CONTROLS`). Every
figure is given on the paper's consistency and on the top-N one (``metrics.topn_consistency``), which sparsity
cannot game. These are one run's controls; pairing them across seeds is ``pairing``'s.
"""

import torch

from bayesncl_pyro._deprecated import moved
from bayesncl_pyro.evaluate import keys
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

RANDOM_MASKS = 5
"""Seeded random masks the null's figures are averaged over."""
Q_DRAWS = 5
"""Draws of g ~ q(g | x) the ``_q_draws`` figures are averaged over."""

DEFINITIONS = {
    keys.F: "F, the evaluated representation: normalise(u * m), m the posterior mode 1[q(g = 1 | x) > 0.5] for "
            "BayesNCL; normalise(relu(z)) (top k kept with --topk) for NCL; normalise(z) for CL",
    keys.UNGATED: "u = normalise(relu(z)), BayesNCL's features with every gate open",
    keys.POSTERIOR_MEAN: "normalise(u * p), p = q(g = 1 | x): the posterior mean's soft gating",
    keys.Q_DRAWS: f"normalise(u * g), g ~ q(g | x): the mean over {Q_DRAWS} seeded draws",
    keys.RANDOM_MASK: f"normalise(u * r), r a random mask keeping each active entry of u with probability "
                      f"random_mask_keep (= F's active entries / u's): the mean over {RANDOM_MASKS} seeded masks",
}
"""What each representation of ``keys.REPRESENTATIONS`` is (eval.json's ``representations``, by the suffix of its
keys); the linear probe and kNN are on backbone features, the same for all."""


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


def _mean(runs: list[dict], representation: str) -> dict:
    return {keys.format(k, representation): sum(r[k] for r in runs) / len(runs) for k in runs[0]}


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
    return dict(_mean(runs, keys.RANDOM_MASK), random_mask_keep=keep)


def posterior_representations(ungated: torch.Tensor, probs: torch.Tensor, labels: torch.Tensor,
                              factors: dict | None = None, seed: int = 0) -> dict:
    """A gated run judged as a posterior: at p and at draws from q, not at its mode.

    :func:`summary` of normalise(u * p) (keys ending in ``_posterior_mean``) and the mean of it over :data:`Q_DRAWS`
    seeded draws normalise(u * g), g ~ Bernoulli(p) (``_q_draws``); u: N x K ungated features, p: N x K q(g = 1 | x).
    """
    g = torch.Generator().manual_seed(seed)
    draws = [summary(normalize(ungated * torch.bernoulli(probs, generator=g)), labels, factors)
             for _ in range(Q_DRAWS)]
    return {**_mean([summary(normalize(ungated * probs), labels, factors)], keys.POSTERIOR_MEAN),
            **_mean(draws, keys.Q_DRAWS)}


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


def __getattr__(name: str):
    return moved(__name__, name)  # the pairing across seeds and its figures moved out (bayesncl_pyro._deprecated)
