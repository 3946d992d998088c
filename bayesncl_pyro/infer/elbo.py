"""The mean-field ELBO without Pyro's per-step tax: the same program, the same loss and gradients."""

from typing import NamedTuple

import torch
from pyro import poutine
from pyro.distributions.util import scale_and_mask
from pyro.infer import TraceMeanField_ELBO
from pyro.infer.inspect import site_is_deterministic
from pyro.infer.util import is_validation_enabled
from pyro.poutine.trace_struct import Trace
from pyro.poutine.util import site_is_subsample
from pyro.util import warn_if_nan
from torch.distributions import kl_divergence

from bayesncl_pyro.errors import UserError


class ELBOTerms(NamedTuple):
    """One evaluation of the ELBO: ``loss`` (-ELBO, differentiable), ``kl`` (the part of it the latent sites
    contribute, detached) and the traces it was computed from (with several particles, the last particle's), where
    whoever monitors training reads what the program computed."""

    loss: torch.Tensor
    kl: torch.Tensor
    model_trace: Trace
    guide_trace: Trace


class MeanFieldELBO(TraceMeanField_ELBO):
    """``TraceMeanField_ELBO`` for programs whose latent sites are reparameterised and have an analytic KL.

    The parent also computes every site's log-density and score parts, which an analytic KL leaves
    unused (for R x K gates: two R x K log-probs per step), checks for NaNs, and calls ``.item()``
    twice per call, each a host sync on a GPU. This runs the same guide trace and model replay and
    sums only what the ELBO needs: each observed site's scaled log-density (the InfoNCE factor)
    minus each latent site's scaled analytic KL (deterministic sites, which add nothing, are skipped). With Pyro
    validation on (or several particles) the traces come from the parent, which runs its model/guide checks, and
    are summed the same way. A subclass that estimates a gradient the traces alone do not give overrides
    :meth:`particle_terms`.
    """

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        return self.terms(model, guide, *args, **kwargs).loss

    def terms(self, model, guide, *args, **kwargs) -> ELBOTerms:
        """The differentiable loss, its KL part and the traces (:class:`ELBOTerms`). The KL is summed as the loss
        is, not recovered from it: a difference of two large float32 numbers would lose it."""
        if is_validation_enabled() or self.num_particles != 1:
            traces = list(self._get_traces(model, guide, args, kwargs))
        else:
            guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
            model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(*args, **kwargs)
            traces = [(model_trace, guide_trace)]
        loss, kl = self.particle_terms(*traces[0])
        for more in traces[1:]:
            more_loss, more_kl = self.particle_terms(*more)
            loss, kl = loss + more_loss, kl + more_kl
        if len(traces) > 1:
            loss, kl = loss / len(traces), kl / len(traces)
        if is_validation_enabled():
            warn_if_nan(loss, "loss")
        return ELBOTerms(loss, kl, *traces[-1])

    def particle_terms(self, model_trace: Trace, guide_trace: Trace) -> tuple[torch.Tensor, torch.Tensor]:
        """(-ELBO, detached KL part) of one pair of traces."""
        return _particle(model_trace, guide_trace)


def _particle(model_trace, guide_trace) -> tuple[torch.Tensor, torch.Tensor]:
    """(-ELBO, detached KL part) of one pair of traces."""
    # -ELBO summed directly, each KL added and each log-density subtracted, not the ELBO negated term by term and
    # then as a whole: the same numbers bit for bit (a negation is exact), two to four ops and autograd nodes fewer
    loss, kl = None, None
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
                term = kl_divergence(q["fn"], site["fn"])
            except NotImplementedError:
                raise NotImplementedError(
                    f"latent site {name!r} has no analytic KL between {type(q['fn']).__name__} and "
                    f"{type(site['fn']).__name__}; register one with torch.distributions.register_kl "
                    "or train with pyro.infer.TraceMeanField_ELBO") from None
            scale, mask = q["scale"], q["mask"]  # TraceMeanField scales the KL by the guide site's
        term = scale_and_mask(term, scale, mask)
        term = term.sum() if term.dim() else term  # a 0-d sum would copy it
        if site["is_observed"]:
            loss = -term if loss is None else loss - term
        else:
            loss = term if loss is None else loss + term
            kl = term.detach() if kl is None else kl + term.detach()
    for name, site in guide_trace.nodes.items():
        # the parent asserts that such a site is auxiliary and adds its entropy; here it would have no term at all
        if site["type"] == "sample" and not site_is_subsample(site) and name not in model_trace.nodes:
            raise UserError(f"guide site {name!r} has no site of that name in the model, so the mean-field ELBO has "
                            "no term for it: sample the same sites in model and guide (an auxiliary guide variable "
                            "needs pyro.infer.TraceMeanField_ELBO)")
    if loss is None:  # no site at all: -ELBO is 0, as the parent has it
        loss = 0.0
    if kl is None:  # no latent site (NCL, CL)
        kl = torch.zeros_like(loss) if torch.is_tensor(loss) else torch.tensor(0.0)
    return loss, kl
