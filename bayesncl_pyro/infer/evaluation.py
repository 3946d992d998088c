"""The head's figures for evaluation: one draw of the objective with the exact KL, and InfoNCE at the mask.

``BayesNCLHead.objective_draw`` and ``BayesNCLHead.mode_nce`` call these; the held-out evaluation
(``evaluate/heldout.py``) reads both on the test split.
"""

import torch

from bayesncl_pyro.infer.elbo import own_params
from bayesncl_pyro.infer.estimators import Draw
from bayesncl_pyro.models.bayesncl import computed
from bayesncl_pyro.nn.losses import info_nce_rows


@torch.no_grad()
def objective_draw(head, h: torch.Tensor) -> dict[str, torch.Tensor]:
    """One draw of the head's objective itself, with the exact KL, whatever the estimator trained.

    For backbone features h of 2B rows: one draw of g ~ q(g | x) (and of the prior's global latents from their q),
    with the exact KL (no clamp). 0-d values:
    ``neg_elbo``, -ELBO / 2N estimated at that draw (unbiased over draws); ``nce``, its InfoNCE term (mean per
    row) and ``kl``, its KL term per row. For NCL and CL, -ELBO = InfoNCE. The rows are contrasted with each
    other only, on one process (no gather across ranks: evaluation runs on rank 0).
    """
    z = head.projector(h)
    kl_weight, draw = head.kl_weight, Draw(kl_clamp=0.0)
    model, guide = head.training_program(draw, kl_weight=kl_weight)
    with own_params():
        terms = head.elbo(draw).terms(model, guide, z, h)
    kl = terms.kl / (head.num_rows * kl_weight) if head.gated else terms.kl
    return dict(neg_elbo=terms.loss / head.num_rows, nce=computed(terms.model_trace)["row_nce"].mean(), kl=kl)


@torch.no_grad()
def mode_nce(head, h: torch.Tensor) -> torch.Tensor:
    """The InfoNCE of the head's evaluation representation, mean per row.

    The representation is ``head.representation(h)`` (for gates, at the evaluation mask). It is deterministic, so it
    is taken once per batch beside the draws of :func:`objective_draw`.
    """
    return info_nce_rows(head.representation(h), head.model.temperature).mean()
