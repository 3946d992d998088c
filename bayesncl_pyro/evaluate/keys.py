"""eval.json's keys: a metric's name and the representation it was measured on, in one string.

A figure of F, the evaluated representation, is keyed by its metric's name alone (``semantic_consistency``); a figure
of another representation of a gated run by that name and the representation's suffix
(``semantic_consistency_q_draws``), except the ungated features' factor counts, recorded under a prefix
(``ungated_dims_tracking_class``). Trained TopK read off its curve at a gated run's sparsity has keys of its own
(:func:`topk`). Every module that writes or reads such a key goes through :func:`format` and :func:`parse`, so that
the recorded results (docs/results) and today's code keep reading the same names.
"""

F, UNGATED, POSTERIOR_MEAN, Q_DRAWS, RANDOM_MASK = "", "ungated", "posterior_mean", "q_draws", "random_mask"
REPRESENTATIONS = (F, UNGATED, POSTERIOR_MEAN, Q_DRAWS, RANDOM_MASK)
"""The representations a figure is measured on, in eval.json's order: F; a gated run's features with every gate open,
gated softly by q's mean, by draws of q, and under random masks as sparse as F (``matched.DEFINITIONS`` says what each
is)."""

_PREFIXED = "dims_tracking_"  # the ungated features' factor counts were recorded as ungated_dims_tracking_<factor>
# the longest first: a key ending in one suffix must not be read as ending in a shorter one
_BY_LENGTH = sorted((r for r in REPRESENTATIONS if r), key=len, reverse=True)


def suffix(representation: str) -> str:
    """The ending of ``representation``'s keys: "" for F, else "_<representation>" (eval.json's ``representations``)."""
    if representation not in REPRESENTATIONS:
        raise ValueError(f"unknown representation {representation!r}; one of {REPRESENTATIONS}")
    return f"_{representation}" if representation else ""


def format(metric: str, representation: str = F) -> str:  # shadows the builtin here only: read as keys.format
    """The eval.json key of ``metric`` measured on ``representation`` (a name of :data:`REPRESENTATIONS`)."""
    if representation == UNGATED and metric.startswith(_PREFIXED):
        return f"{UNGATED}_{metric}"
    return metric + suffix(representation)


def parse(key: str) -> tuple[str, str]:
    """(metric, representation) of an eval.json key: :func:`format`'s inverse; a key of no suffix is F's."""
    if key.startswith(f"{UNGATED}_{_PREFIXED}"):
        return key.removeprefix(f"{UNGATED}_"), UNGATED
    for representation in _BY_LENGTH:
        if key.endswith(f"_{representation}"):
            return key.removesuffix(f"_{representation}"), representation
    return key, F


WITHOUT_NCL = "_without_ncl"
"""The ending of trained TopK's keys read off a curve of TopK runs alone (:func:`topk`)."""


def topk(metric: str, measure: str, without_ncl: bool = False, reading: str = "") -> str:
    """The key of trained TopK's ``metric`` read off its seed's curve at a gated run's ``measure``.

    ``measure``: a key of ``pairing.MATCH_ON`` (``rate`` or ``sparsity``); ``without_ncl``: the curve of TopK runs
    alone, without NCL as its point at k = K; ``reading``: another reading of the curve than the linear one (a key of
    ``pairing.READINGS``).
    """
    return f"topk_{metric}_at_{measure}" + (WITHOUT_NCL if without_ncl else "") + (f"_{reading}" if reading else "")
