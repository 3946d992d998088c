"""The mean-field ELBO without Pyro's per-step tax: the same program, the same loss and gradients."""

from collections.abc import Callable
from typing import NamedTuple

import torch
from pyro import poutine
from pyro.distributions.util import scale_and_mask
from pyro.infer import TraceMeanField_ELBO
from pyro.infer.enum import get_importance_trace
from pyro.infer.inspect import site_is_deterministic
from pyro.infer.util import is_validation_enabled
from pyro.poutine.trace_struct import Trace
from pyro.poutine.util import site_is_subsample
from pyro.util import warn_if_nan
from torch.distributions import Bernoulli, Independent, kl_divergence

from bayesncl_pyro.errors import UserError
from bayesncl_pyro.nn.losses import bernoulli_kl


class ELBOTerms(NamedTuple):
    """One evaluation of the ELBO: the loss, its KL part and the traces.

    ``loss`` is -ELBO (differentiable), ``kl`` the part of it the latent sites contribute (detached), and the traces
    are those it was computed from (with several particles, the last particle's), where whoever monitors training
    reads what the program computed.
    """

    loss: torch.Tensor
    kl: torch.Tensor
    model_trace: Trace
    guide_trace: Trace


class MeanFieldELBO(TraceMeanField_ELBO):
    """The mean-field ELBO with one objective for SVI, differentiable_loss and the trainer.

    ``TraceMeanField_ELBO`` for programs whose latent sites are reparameterised, with one objective for Pyro's
    ``SVI`` (the parent's ``loss_and_grads``), :meth:`differentiable_loss` and the trainer (:meth:`terms`): each
    particle's terms are summed in :meth:`_differentiable_loss_particle`, Pyro's override point, which a subclass
    extends (``LocalExpectationELBO``, as ``pyro.contrib.cevae``'s ``TraceCausalEffect_ELBO`` extends Trace_ELBO).

    The parent also computes every site's log-density and score parts, which an analytic KL leaves
    unused (for R x K gates: two R x K log-probs per step), checks for NaNs, and calls ``.item()``
    twice per call, each a host sync on a GPU. :meth:`terms` runs the same guide trace and model replay and
    sums only what the ELBO needs: each observed site's scaled log-density (the InfoNCE factor)
    minus each latent site's scaled KL, analytic where ``torch.distributions.kl`` has one registered for the pair,
    otherwise estimated at the guide's value, log q - log p (deterministic sites, which add nothing, are skipped).
    Each latent site's KL term is kept in its guide site as ``site["kl"]``, as a trace keeps a site's
    ``log_prob_sum``, and the KL part is summed from there. With Pyro validation on, the traces are Pyro's
    (``get_importance_trace``, which runs its checks of the program).

    Args:
        kl_clamp: None, each site's registered KL; a number c, for a site whose q and p are both Bernoullis (the
            gates), the KL with both rates clamped to [c, 1 - c] (``nn.losses.bernoulli_kl``; 0.01 the reference's
            clamp, 0 the exact KL): the training objective, which no distribution's KL states.
        kl_probs: with ``kl_clamp``, q's rates the KL is taken at, from q's Bernoulli (default its ``probs``;
            ``gs-reference-kl`` takes sigmoid(l)).
        **kwargs: ``TraceMeanField_ELBO``'s (``num_particles``, ...).
    """

    def __init__(self, kl_clamp: float | None = None, kl_probs: Callable[[Bernoulli], torch.Tensor] | None = None,
                 **kwargs):
        super().__init__(**kwargs)
        self.kl_clamp, self.kl_probs = kl_clamp, kl_probs or _probs

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        """-ELBO, differentiable: the loss of :meth:`terms`."""
        return self.terms(model, guide, *args, **kwargs).loss

    def terms(self, model, guide, *args, **kwargs) -> ELBOTerms:
        """The differentiable loss, its KL part and the traces (:class:`ELBOTerms`).

        The KL is summed as the loss is, not recovered from it: a difference of two large float32 numbers would
        lose it.
        """
        particles = []
        for _ in range(self.num_particles):
            traces = self._traces(model, guide, args, kwargs)
            particles.append((self._differentiable_loss_particle(*traces)[1], _kl_part(traces[1]), traces))
        loss, kl, traces = particles[0]
        for more_loss, more_kl, traces in particles[1:]:
            loss, kl = loss + more_loss, kl + more_kl
        if len(particles) > 1:
            loss, kl = loss / len(particles), kl / len(particles)
        if is_validation_enabled():
            warn_if_nan(loss, "loss")
        if not torch.is_tensor(kl):  # no latent site (NCL, CL)
            kl = torch.zeros_like(loss) if torch.is_tensor(loss) else torch.tensor(0.0)
        return ELBOTerms(loss, kl, *traces)

    def _traces(self, model, guide, args, kwargs) -> tuple[Trace, Trace]:
        """(model trace, guide trace) of one particle: the guide traced, the model replayed against it."""
        if is_validation_enabled():
            return get_importance_trace("flat", self.max_plate_nesting, model, guide, args, kwargs)
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        return poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(*args, **kwargs), guide_trace

    def _differentiable_loss_particle(self, model_trace: Trace, guide_trace: Trace) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
        """(-ELBO detached, -ELBO) of one pair of traces: the mean-field terms (:func:`_particle`)."""
        loss = _particle(model_trace, guide_trace, self._kl)
        return loss.detach(), loss

    def _kl(self, q, p) -> torch.Tensor:
        """KL(q || p) of one latent site, summed over its event dimensions.

        The clamped Bernoulli KL for a pair of Bernoullis when a clamp is given, else the registered one
        (NotImplementedError where none is).
        """
        if self.kl_clamp is not None:
            q_base, p_base, event_dims = _bernoulli_pair(q, p)
            if q_base is not None:
                kl = bernoulli_kl(self.kl_probs(q_base), p_base.probs, self.kl_clamp)
                # as torch's KL of two Independents sums its base KL
                return kl.reshape(kl.shape[:-event_dims] + (-1,)).sum(-1) if event_dims else kl
        return kl_divergence(q, p)


def _probs(q: Bernoulli) -> torch.Tensor:
    return q.probs


def _bernoulli_pair(q, p) -> tuple[Bernoulli | None, Bernoulli | None, int]:
    """The Bernoulli pair inside q and p, if both are Bernoullis of equal event dimensions.

    (q's Bernoulli, p's Bernoulli, their event dimensions) when both are Bernoullis of equal event dimensions
    (bare or wrapped in one Independent each), else (None, None, 0).
    """
    dims = q.reinterpreted_batch_ndims if isinstance(q, Independent) else 0
    if isinstance(p, Independent) != bool(dims) or (dims and p.reinterpreted_batch_ndims != dims):
        return None, None, 0
    if dims:
        q, p = q.base_dist, p.base_dist
    if isinstance(q, Bernoulli) and isinstance(p, Bernoulli):
        return q, p, dims
    return None, None, 0


def _kl_part(guide_trace: Trace) -> torch.Tensor | float:
    """The part of -ELBO the latent sites contribute, detached.

    It sums their KL terms, which :func:`_particle` keeps in the guide trace; 0.0 without latent sites (NCL, CL).
    """
    kl = 0.0
    for site in guide_trace.nodes.values():
        if "kl" in site:
            kl = kl + site["kl"]
    return kl


def _particle(model_trace: Trace, guide_trace: Trace, kl) -> torch.Tensor:
    """-ELBO of one pair of traces.

    ``kl(q, p)`` is the KL of a latent site; each latent site's KL term, detached, is kept in its guide site as
    ``"kl"``.
    """
    # -ELBO summed directly, each KL added and each log-density subtracted, not the ELBO negated term by term and
    # then as a whole: the same numbers bit for bit (a negation is exact), two to four ops and autograd nodes fewer
    loss = None
    for name, site in model_trace.nodes.items():
        if site["type"] != "sample" or site_is_subsample(site) or site_is_deterministic(site):
            continue
        if site["is_observed"]:
            term = site["fn"].log_prob(site["value"])
            scale, mask = site["scale"], site["mask"]
        else:
            q = guide_trace.nodes[name]
            if not q["fn"].has_rsample:  # only pathwise gradients are taken here: a score term would be lost
                raise NotImplementedError(
                    f"latent site {name!r} ({type(q['fn']).__name__}) is not reparameterised: its gradient "
                    "needs a score-function term; train with pyro.infer.TraceGraph_ELBO")
            try:
                term = kl(q["fn"], site["fn"])
            except NotImplementedError:  # one-draw Monte Carlo KL at q's value, TraceMeanField_ELBO's fallback
                term = q["fn"].log_prob(site["value"]) - site["fn"].log_prob(site["value"])
            scale, mask = q["scale"], q["mask"]  # TraceMeanField scales the KL by the guide site's
        term = scale_and_mask(term, scale, mask)
        term = term.sum() if term.dim() else term  # a 0-d sum would copy it
        if site["is_observed"]:
            loss = -term if loss is None else loss - term
        else:
            loss = term if loss is None else loss + term
            q["kl"] = term.detach()
    for name, site in guide_trace.nodes.items():
        # the parent asserts that such a site is auxiliary and adds its entropy; here it would have no term at all
        if site["type"] == "sample" and not site_is_subsample(site) and name not in model_trace.nodes:
            raise UserError(f"guide site {name!r} has no site of that name in the model, so the mean-field ELBO has "
                            "no term for it: sample the same sites in model and guide (an auxiliary guide variable "
                            "needs pyro.infer.TraceMeanField_ELBO)")
    return 0.0 if loss is None else loss  # no site at all: -ELBO is 0, as the parent has it
