"""The head's evaluation API (:class:`HeadEvaluation`): its gates, representation and figures, after training.

One draw of the objective with the exact KL and InfoNCE at the mask (the held-out evaluation, ``evaluate/heldout.py``,
reads both on the test split), the posterior's probabilities and mask, the representation F, and how hard InfoNCE and
the prior pulled on a step's gates.
"""

import torch

from bayesncl_pyro.errors import UserError
from bayesncl_pyro.infer.elbo import own_params
from bayesncl_pyro.infer.estimators import Draw
from bayesncl_pyro.infer.output import HeadOutput, gate_pulls
from bayesncl_pyro.models.bayesncl import computed
from bayesncl_pyro.models.priors import gate_rates
from bayesncl_pyro.nn.losses import info_nce_rows, normalize


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


class HeadEvaluation:
    """The evaluation API of :class:`~bayesncl_pyro.infer.head.BayesNCLHead`, which it is mixed into."""

    def objective_draw(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        """One draw of the objective with the exact KL, whatever the estimator trained (:func:`objective_draw`).

        Args:
            h: R x D backbone features of the rows ``[view 1 of B images; view 2 of the same B images]``.

        Returns:
            0-d values by name: ``neg_elbo`` (-ELBO / 2N at the draw), ``nce`` (its InfoNCE term) and ``kl`` (its KL
            term per row).
        """
        return objective_draw(self, h)

    def mode_nce(self, h: torch.Tensor) -> torch.Tensor:
        """The InfoNCE of the evaluation's representation, mean per row (:func:`mode_nce`).

        Args:
            h: R x D backbone features of the rows ``[view 1 of B images; view 2 of the same B images]``.

        Returns:
            The 0-d mean InfoNCE per row of :meth:`representation`.
        """
        return mode_nce(self, h)

    def _need_gates(self):
        if not self.gated:
            raise UserError("this head has no gates (prior=None: NCL or CL); build it with a prior for BayesNCL")

    def pulls(self, out: HeadOutput) -> dict[str, float]:
        """After ``loss.backward()``: how hard InfoNCE and the prior pull on the step's gates.

        The step is the one that returned ``out``; the figures are ``gate_nce_pull`` and ``gate_prior_pull``
        (``gate_pulls``, the prior's at the probabilities, the rates and the lambda the step's KL used).

        Args:
            out: the :class:`HeadOutput` of the step, after its loss's ``backward()``.

        Returns:
            ``{"gate_nce_pull": float, "gate_prior_pull": float}``; empty before the backward, or without gates.
        """
        gates = out.gates
        if gates is None or gates.grad is None:
            return {}
        # each row against its own rates: a prior with a rate per row (per-image) has R x K
        rates = gate_rates(out.prior).detach()  # by draws for a prior without a mean
        nce, prior = gate_pulls(gates.grad, out.kl_probs, rates, out.kl_weight, out.estimator.kl_clamp)
        return dict(gate_nce_pull=nce, gate_prior_pull=prior)

    def gate_probs(self, h: torch.Tensor) -> torch.Tensor:
        """The posterior inclusion probabilities q(g_k = 1 | x), R x K, from backbone features h.

        q's family is the gate estimator's.

        Args:
            h: R x D backbone features of the rows ``[view 1 of B images; view 2 of the same B images]``.

        Returns:
            R x K probabilities in (0, 1).

        Raises:
            UserError: the head has no gates (NCL or CL).
        """
        self._need_gates()
        return self.guide.posterior(h).probs

    @torch.no_grad()
    def gate_mask(self, h: torch.Tensor) -> torch.Tensor:
        """The 0/1 gates the evaluation uses, R x K, from backbone features h: the posterior mode.

        The mode is 1[q(g = 1 | x) > 0.5]; for ``gs-reference-kl`` the mask is the reference's, 1[sigmoid(l) > 0.5].

        Args:
            h: R x D backbone features of the rows ``[view 1 of B images; view 2 of the same B images]``.

        Returns:
            The R x K mask of 0s and 1s.

        Raises:
            UserError: the head has no gates (NCL or CL).
        """
        self._need_gates()
        return self.estimator.mask(self.guide.posterior(h))

    @torch.no_grad()
    def representation(self, h: torch.Tensor) -> torch.Tensor:
        """F, the gated representation the method is evaluated on.

        normalise(features(z) * m) with m the evaluation mask (:meth:`gate_mask`) with gates, features(z) without
        (normalise(relu(z)) for NCL, normalise(z) for CL).

        Args:
            h: R x D backbone features of the rows ``[view 1 of B images; view 2 of the same B images]``.

        Returns:
            F, R x K, each row of unit norm (or zero).
        """
        feats = self.ungated_features(h)
        if self.gated:
            feats = normalize(feats * self.gate_mask(h).to(feats))
        return feats

    @torch.no_grad()
    def ungated_features(self, h: torch.Tensor) -> torch.Tensor:
        """The features of backbone features h with every gate open: normalise(relu(z)), as NCL's.

        Args:
            h: R x D backbone features of the rows ``[view 1 of B images; view 2 of the same B images]``.

        Returns:
            The R x K features before gating, L2-normalised: non-negative as ``nonneg`` says, top-k if ``topk``.
        """
        return self.model.features(self.projector(h))
