"""The mean-field ELBO without Pyro's per-step tax: the same program, the same loss and gradients."""

from collections.abc import Callable
from typing import NamedTuple

import pyro
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
from torch.distributions import Bernoulli

from bayesncl_pyro.errors import UserError
from bayesncl_pyro.infer.kl import PATHWISE, site_kl


def own_params():
    """An empty Pyro param store for the duration, so heads do not share parameters.

    The Pyro modules run inside use their own parameters (a learned prior's rate, a Beta posterior), not an entry of the
    process's global store under the same name, which two heads of one process would share, the second then training a
    parameter its optimizer does not hold. Pyro's ``module_local_params`` is no substitute: it must be on both when a
    module is built and at each call, so set for the process it would break the user's own PyroModules.
    """
    return pyro.get_param_store().scope()


class ELBOTerms(NamedTuple):
    """One evaluation of the ELBO: the loss, its KL part, the traces, and what the ELBO computed per site.

    ``loss`` is -ELBO (differentiable), ``kl`` the part of it the latent sites contribute (detached), and the traces
    are those it was computed from (with several particles, the last particle's), where whoever monitors training
    reads what the program computed. ``site_kl``: each latent site's scaled KL term (detached; the last particle's);
    ``kl_kind``: how each was estimated (``infer.kl``); ``gate_probs``: for ``leg``, the node of q's probabilities
    whose gradient after backward is InfoNCE's alone (None otherwise).
    """

    loss: torch.Tensor
    kl: torch.Tensor
    model_trace: Trace
    guide_trace: Trace
    site_kl: dict[str, torch.Tensor] = {}
    kl_kind: dict[str, str] = {}
    gate_probs: torch.Tensor | None = None


class Particle(NamedTuple):
    """-ELBO of one pair of traces, with each latent site's KL term (detached) and how it was estimated."""

    loss: torch.Tensor | float
    site_kl: dict[str, torch.Tensor]
    kl_kind: dict[str, str]
    gate_probs: torch.Tensor | None = None


class MeanFieldELBO(TraceMeanField_ELBO):
    """The mean-field ELBO with one objective for SVI, differentiable_loss and the trainer.

    ``TraceMeanField_ELBO`` for programs whose latent sites are reparameterised, with one objective for Pyro's
    ``SVI`` (the parent's ``loss_and_grads``), :meth:`differentiable_loss` and the trainer (:meth:`terms`): each
    particle's terms are summed in :meth:`particle`, which Pyro's override point ``_differentiable_loss_particle``
    calls and a subclass extends (``LocalExpectationELBO``, as ``pyro.contrib.cevae``'s ``TraceCausalEffect_ELBO``
    extends Trace_ELBO).

    The parent also computes every site's log-density and score parts, which an analytic KL leaves
    unused (for R x K gates: two R x K log-probs per step), checks for NaNs, and calls ``.item()``
    twice per call, each a host sync on a GPU. :meth:`terms` runs the same guide trace and model replay and
    sums only what the ELBO needs: each observed site's scaled log-density (the InfoNCE factor)
    plus each latent site's scaled KL, taken as ``infer.kl.site_kl`` says (analytic where one is registered; for the
    gates exact or with an unbiased gradient otherwise). Deterministic sites, which add nothing, are skipped; a guide
    site marked auxiliary (an autoguide's unconstrained draw) adds its log-density, the rest of q's, as the parent
    does. With Pyro validation on, the traces are Pyro's (``get_importance_trace``, which runs its checks of the
    program).

    Args:
        kl_clamp: None, each site's registered KL; a number c, for a gate site (q a product of Bernoullis) the KL
            with its rates clamped to [c, 1 - c] (``nn.losses.bernoulli_kl``; 0.01 the reference's clamp, 0 the exact
            KL): the training objective, which no distribution's KL states.
        kl_probs: with ``kl_clamp``, q's rates the KL is taken at, from q's Bernoulli (default its ``probs``;
            ``gs-reference-kl`` takes sigmoid(l)).
        **kwargs: ``TraceMeanField_ELBO``'s (``num_particles``, ...).
    """

    def __init__(self, kl_clamp: float | None = None, kl_probs: Callable[[Bernoulli], torch.Tensor] | None = None,
                 **kwargs):
        super().__init__(**kwargs)
        self.kl_clamp, self.kl_probs = kl_clamp, kl_probs

    def differentiable_loss(self, model, guide, *args, **kwargs) -> torch.Tensor:
        """-ELBO, differentiable: the loss of :meth:`terms`."""
        return self.terms(model, guide, *args, **kwargs).loss

    def terms(self, model, guide, *args, **kwargs) -> ELBOTerms:
        """The differentiable loss, its KL part, the traces and the per-site KL terms (:class:`ELBOTerms`).

        Per particle, -ELBO = sum over latent sites of scale * KL(q || p) - sum over observed sites of scale *
        log p (the InfoNCE factor), averaged over ``num_particles``. The KL is summed as the loss is, not recovered
        from it: a difference of two large float32 numbers would lose it.

        Args:
            model: the model program.
            guide: the guide program.
            *args: the programs' arguments.
            **kwargs: the programs' keyword arguments.

        Returns:
            :class:`ELBOTerms`: the loss (-ELBO), its KL part, the last particle's traces, its per-site KL terms,
            how each was estimated and its gate probabilities node.
        """
        loss = kl = None
        for _ in range(self.num_particles):
            traces = self._traces(model, guide, args, kwargs)
            particle = self.particle(*traces)
            more_kl = sum(particle.site_kl.values()) if particle.site_kl else 0.0
            loss, kl = (particle.loss, more_kl) if loss is None else (loss + particle.loss, kl + more_kl)
        if self.num_particles > 1:
            loss, kl = loss / self.num_particles, kl / self.num_particles
        if is_validation_enabled():
            warn_if_nan(loss, "loss")
        if not torch.is_tensor(kl):  # no latent site (NCL, CL)
            kl = torch.zeros_like(loss) if torch.is_tensor(loss) else torch.tensor(0.0)
        return ELBOTerms(loss, kl, *traces, particle.site_kl, particle.kl_kind, particle.gate_probs)

    def _traces(self, model, guide, args, kwargs) -> tuple[Trace, Trace]:
        """(model trace, guide trace) of one particle: the guide traced, the model replayed against it."""
        if is_validation_enabled():
            return get_importance_trace("flat", self.max_plate_nesting, model, guide, args, kwargs)
        guide_trace = poutine.trace(guide).get_trace(*args, **kwargs)
        return poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(*args, **kwargs), guide_trace

    def particle(self, model_trace: Trace, guide_trace: Trace) -> Particle:
        """-ELBO of one pair of traces, with its per-site KL terms (:class:`Particle`)."""
        return _particle(model_trace, guide_trace, self._kl)

    def _differentiable_loss_particle(self, model_trace: Trace, guide_trace: Trace) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
        """(-ELBO detached, -ELBO) of one pair of traces, Pyro's override point: :meth:`particle`'s loss."""
        loss = self.particle(model_trace, guide_trace).loss
        return (loss.detach() if torch.is_tensor(loss) else loss), loss

    def _kl(self, q, p, value) -> tuple[torch.Tensor, str]:
        """(KL(q || p) of one latent site summed over its event dimensions, how it was estimated): ``infer.kl``."""
        return site_kl(q, p, value, self.kl_probs, self.kl_clamp)


def _particle(model_trace: Trace, guide_trace: Trace, kl) -> Particle:
    """-ELBO of one pair of traces, ``kl(q, p, value)`` giving a latent site's (KL term, how estimated)."""
    # -ELBO summed directly, each KL added and each log-density subtracted, not the ELBO negated term by term and
    # then as a whole: the same numbers bit for bit (a negation is exact), two to four ops and autograd nodes fewer
    loss, site_kls, kinds = None, {}, {}
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
            term, kinds[name] = kl(q["fn"], site["fn"], q["value"])
            scale, mask = q["scale"], q["mask"]  # TraceMeanField scales the KL by the guide site's
        term = scale_and_mask(term, scale, mask)
        term = term.sum() if term.dim() else term  # a 0-d sum would copy it
        if site["is_observed"]:
            loss = -term if loss is None else loss - term
        else:
            loss = term if loss is None else loss + term
            site_kls[name] = term.detach()
    for name, site in guide_trace.nodes.items():
        if site["type"] != "sample" or site_is_subsample(site) or name in model_trace.nodes:
            continue
        if not site["infer"].get("is_auxiliary"):
            # the parent asserts that such a site is auxiliary and adds its log-density; unmarked, it has no term
            raise UserError(f"guide site {name!r} has no site of that name in the model, so the mean-field ELBO has "
                            "no term for it: sample the same sites in model and guide, or mark a guide-only draw "
                            "infer={'is_auxiliary': True} (as Pyro's autoguides do)")
        # an autoguide's unconstrained draw: its log-density is the rest of log q at the site it transforms into
        term = scale_and_mask(site["fn"].log_prob(site["value"]), site["scale"], site["mask"]).sum()
        loss = term if loss is None else loss + term
        site_kls[name] = term.detach()
        kinds[name] = PATHWISE
    return Particle(0.0 if loss is None else loss, site_kls, kinds)  # no site at all: -ELBO is 0, as the parent has it
