"""The fast mean-field ELBO equals Pyro's TraceMeanField_ELBO on the same program: loss and gradients."""

import pyro
import pytest
import torch
from pyro import poutine
from pyro.distributions.util import scale_and_mask
from pyro.infer import TraceMeanField_ELBO
from pyro.poutine.util import site_is_subsample
from torch.distributions import kl_divergence

from bayesncl_pyro.config import Config
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.infer.elbo import MeanFieldELBO
from bayesncl_pyro.infer.estimators import GATES, local_expectation_term
from bayesncl_pyro.infer.head import own_params
from bayesncl_pyro.infer.learner import ContrastiveLearner
from bayesncl_pyro.models.priors import PRIORS
from bayesncl_pyro.train.resolve import resolve

CASES = [("cl", "bernoulli", "ste"), ("ncl", "bernoulli", "ste")] + [
    ("bayesncl", prior, gate) for prior in sorted(PRIORS) for gate in GATES]


class PyroLocalExpectation(TraceMeanField_ELBO):
    """Pyro's ELBO with leg's head-gradient term added to each particle, as ``LocalExpectationELBO`` adds it to ours."""

    def __init__(self, temperature):
        super().__init__()
        self.temperature = temperature

    def _differentiable_loss_particle(self, model_trace, guide_trace):
        loss, surrogate = super()._differentiable_loss_particle(model_trace, guide_trace)
        return loss, surrogate + local_expectation_term(model_trace, guide_trace, self.temperature)


def _loss_and_grads(learner, elbo, x):
    """The training path (the head's own fast ELBO), or Pyro's ``elbo`` on the head's program."""
    learner.zero_grad()
    pyro.set_rng_seed(3)  # same gate and rate draws for both ELBOs
    if isinstance(elbo, MeanFieldELBO):
        loss, _ = learner(x)
    else:
        head = learner.head
        h = learner.backbone(x)
        z = head.projector(h)
        model, guide = head.training_program()
        with own_params():
            loss = elbo.differentiable_loss(model, guide, z, h) / head.num_rows
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in learner.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("method, prior, gate", CASES)
def test_fast_elbo_matches_trace_mean_field(method, prior, gate):
    cfg = resolve(Config(dataset="digits", method=method, prior=prior, gate=gate, proj_hidden=32, proj_dim=16, kl_weight=0.05))
    learner = ContrastiveLearner(cfg, in_channels=1, num_train=100)
    x = torch.randn(12, 1, 8, 8)
    with pyro.validation_enabled(False):  # with validation on the fast ELBO defers to its parent
        fast, fast_grads = _loss_and_grads(learner, MeanFieldELBO(), x)
        pyros = PyroLocalExpectation(learner.model.temperature) if gate == "leg" else TraceMeanField_ELBO()
        plain, plain_grads = _loss_and_grads(learner, pyros, x)
    torch.testing.assert_close(fast, plain)
    assert fast_grads.keys() == plain_grads.keys()
    assert method != "bayesncl" or any(n.startswith("head.guide.") for n in fast_grads)
    for name in plain_grads:
        torch.testing.assert_close(fast_grads[name], plain_grads[name], msg=name)


def test_fast_elbo_names_a_latent_site_without_analytic_kl():
    def model():
        pyro.sample("w", pyro.distributions.Normal(0.0, 1.0))

    def guide():
        pyro.sample("w", pyro.distributions.Cauchy(0.0, 1.0))

    with pyro.validation_enabled(False), pytest.raises(NotImplementedError, match="'w'.*register_kl"):
        MeanFieldELBO().differentiable_loss(model, guide)


def test_fast_elbo_refuses_a_latent_site_that_needs_a_score_function_term():
    """Only pathwise gradients are taken: a non-reparameterised guide site would silently lose its score term."""
    def model():
        pyro.sample("b", pyro.distributions.Bernoulli(0.3))

    def guide():
        pyro.sample("b", pyro.distributions.Bernoulli(0.6))

    with pyro.validation_enabled(False), pytest.raises(NotImplementedError, match="'b'.*not reparameterised"):
        MeanFieldELBO().differentiable_loss(model, guide)


def test_fast_elbo_refuses_a_site_that_only_the_guide_samples():
    """The parent asserts that such a site is auxiliary and adds its entropy; the fast ELBO would give it no term."""
    def model():
        pyro.sample("w", pyro.distributions.Normal(0.0, 1.0))

    def guide():
        pyro.sample("w", pyro.distributions.Normal(1.0, 1.0))
        pyro.sample("extra", pyro.distributions.Normal(0.0, 2.0))

    for validation in (False, True):
        with pyro.validation_enabled(validation), pytest.raises(UserError, match="guide site 'extra' has no site"):
            MeanFieldELBO().differentiable_loss(model, guide)


def _negated_elbo(model_trace, guide_trace):
    """The ELBO summed as Pyro writes it, then negated: each KL negated, scaled and summed, each log-density scaled
    and summed, the terms added to 0, the sum negated; the KL part summed the same way."""
    elbo, kl = 0.0, 0.0
    for name, site in model_trace.nodes.items():
        if site["type"] != "sample" or site_is_subsample(site):
            continue
        if site["is_observed"]:
            term, where = site["fn"].log_prob(site["value"]), site
        else:
            term, where = -kl_divergence(guide_trace.nodes[name]["fn"], site["fn"]), guide_trace.nodes[name]
        term = scale_and_mask(term, where["scale"], where["mask"]).sum()
        elbo = elbo + term
        if not site["is_observed"]:
            kl = kl - term.detach()
    return -elbo, kl


@pytest.mark.parametrize("method, prior, gate", [("cl", "bernoulli", "ste"), ("bayesncl", "bernoulli", "st-sampled"),
                                                 ("bayesncl", "beta-bernoulli", "ste"), ("bayesncl", "learned", "leg")])
def test_the_loss_summed_without_negations_is_the_negated_elbo_bit_for_bit(method, prior, gate):
    """MeanFieldELBO adds each KL and subtracts each log-density instead of negating terms and their sum: the loss,
    its KL part and every gradient are those of the negated sum, bit for bit (two latent sites with beta-bernoulli,
    none for CL, a prior rate with a gradient for learned)."""
    cfg = resolve(Config(dataset="digits", method=method, prior=prior, gate=gate, proj_hidden=32, proj_dim=16,
                         kl_weight=0.05))
    learner = ContrastiveLearner(cfg, in_channels=1, num_train=100)
    x = torch.randn(12, 1, 8, 8)
    results = []
    for particle in (MeanFieldELBO().particle_terms, _negated_elbo):
        learner.zero_grad()
        pyro.set_rng_seed(3)
        head = learner.head
        h = learner.backbone(x)
        model, guide = head.training_program()
        with pyro.validation_enabled(False), own_params():
            guide_trace = poutine.trace(guide).get_trace(head.projector(h), h)
            model_trace = poutine.trace(poutine.replay(model, trace=guide_trace)).get_trace(head.projector(h), h)
        loss, kl = particle(model_trace, guide_trace)
        loss.backward()
        results.append((loss.detach(), kl, {n: p.grad.clone() for n, p in learner.named_parameters()
                                            if p.grad is not None}))
    (loss, kl, grads), (want_loss, want_kl, want_grads) = results
    assert torch.equal(loss, want_loss) and torch.equal(torch.as_tensor(kl), torch.as_tensor(want_kl))
    assert grads.keys() == want_grads.keys() and any(n.startswith("head.projector.") for n in grads)
    for name in grads:
        assert torch.equal(grads[name], want_grads[name]), name
