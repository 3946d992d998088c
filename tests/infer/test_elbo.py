"""The fast mean-field ELBO equals Pyro's TraceMeanField_ELBO on the same program: loss and gradients; SVI, the ELBO
and the trainer train one objective."""

import pyro
import pytest
import torch
from pyro import poutine
from pyro.distributions.util import scale_and_mask
from pyro.infer import SVI, Predictive, TraceMeanField_ELBO
from pyro.poutine.util import site_is_subsample
from torch.distributions import kl_divergence

from bayesncl_pyro import BayesNCLHead
from bayesncl_pyro.config import Config
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.guides.gates import BernoulliGates
from bayesncl_pyro.infer.elbo import MeanFieldELBO
from bayesncl_pyro.infer.estimators import GATES, Draw, local_expectation_term
from bayesncl_pyro.infer.head import own_params
from bayesncl_pyro.infer.learner import ContrastiveLearner
from bayesncl_pyro.models.priors import PRIORS
from bayesncl_pyro.train.resolve import resolve

# gs-reference-kl's KL is taken at sigmoid(l), not at q's P(on): no KL(q || p), which is all the stock ELBO takes
CASES = [("cl", "bernoulli", "ste"), ("ncl", "bernoulli", "ste")] + [
    ("bayesncl", prior, gate) for prior in sorted(PRIORS) for gate in GATES if gate != "gs-reference-kl"]


class PyroWithJacobian(TraceMeanField_ELBO):
    """Pyro's ELBO with each autoguide site's Jacobian added back.

    An autoguide samples a constrained latent as a ``Delta`` carrying log|det J| of its transform (``log_density``);
    Pyro's registered KL(Delta || p) is -log p(v), which drops it, and ours keeps it (``infer.kl``). ibp's default
    AutoNormal has two such sites (alpha, the sticks).
    """

    def _differentiable_loss_particle(self, model_trace, guide_trace):
        loss, surrogate = super()._differentiable_loss_particle(model_trace, guide_trace)
        for site in guide_trace.nodes.values():
            if site["type"] == "sample" and isinstance(site["fn"], pyro.distributions.Delta):
                jacobian = scale_and_mask(site["fn"].log_density, site["scale"], site["mask"]).sum()
                loss, surrogate = loss + jacobian.detach(), surrogate + jacobian
        return loss, surrogate


class PyroLocalExpectation(PyroWithJacobian):
    """Pyro's ELBO with leg's head-gradient term added to each particle, as ``LocalExpectationELBO`` adds it to ours."""

    def _differentiable_loss_particle(self, model_trace, guide_trace):
        loss, surrogate = super()._differentiable_loss_particle(model_trace, guide_trace)
        return loss, surrogate + local_expectation_term(model_trace, guide_trace)[0]


def _loss_and_grads(learner, elbo, x):
    """The training path (the head's own fast ELBO), or Pyro's ``elbo`` on the head's program."""
    learner.zero_grad()
    pyro.set_rng_seed(3)  # same gate and rate draws for both ELBOs
    if elbo is None:
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
    """At ``kl_clamp=0``: the clamp is the head's ELBO's argument, and the stock ELBO takes the registered KL."""
    cfg = resolve(Config(dataset="digits", method=method, prior=prior, gate=gate, proj_hidden=32, proj_dim=16,
                         kl_weight=0.05, kl_clamp=0.0))
    learner = ContrastiveLearner(cfg, in_channels=1, num_train=100)
    x = torch.randn(12, 1, 8, 8)
    with pyro.validation_enabled(False):  # with validation on the fast ELBO defers to its parent
        fast, fast_grads = _loss_and_grads(learner, None, x)
        pyros = PyroLocalExpectation() if gate == "leg" else PyroWithJacobian()
        plain, plain_grads = _loss_and_grads(learner, pyros, x)
    torch.testing.assert_close(fast, plain)
    assert fast_grads.keys() == plain_grads.keys()
    assert method != "bayesncl" or any(n.startswith("head.guide.") for n in fast_grads)
    for name in plain_grads:
        torch.testing.assert_close(fast_grads[name], plain_grads[name], msg=name)


def test_without_an_analytic_kl_the_fast_elbo_is_pyros_monte_carlo_kl():
    """No KL registered for (Cauchy, Normal): both ELBOs estimate it at the guide's draw, log q - log p."""
    loc = torch.tensor(0.3, requires_grad=True)

    def model():
        pyro.sample("w", pyro.distributions.Normal(0.0, 1.0))

    def guide():
        pyro.sample("w", pyro.distributions.Cauchy(loc, 1.0))

    losses = []
    with pyro.validation_enabled(False):
        for elbo in (MeanFieldELBO(), TraceMeanField_ELBO()):
            pyro.set_rng_seed(0)
            loss = elbo.differentiable_loss(model, guide)
            losses.append((loss.detach(), *torch.autograd.grad(loss, loc)))
    torch.testing.assert_close(losses[0], losses[1])


def test_the_monte_carlo_kl_of_bernoulli_gates_is_the_analytic_kl_on_average():
    """A prior over the gates with no registered KL (Binomial(1, rho), Bernoulli(rho) in law) gets the one-draw
    estimate log q(g) - log p(g); its mean over many gates is KL(Bernoulli(q) || Bernoulli(rho)), within four standard
    errors (the estimate's exact variance under q)."""
    rows, k = 4000, 8
    rho = torch.linspace(0.2, 0.9, k)
    probs = torch.rand(rows, k, generator=torch.Generator().manual_seed(1)) * 0.9 + 0.05

    def model():
        with pyro.plate("rows", rows):
            pyro.sample("g", pyro.distributions.Binomial(1, rho.expand(rows, k)).to_event(1))

    def guide():
        with pyro.plate("rows", rows):
            pyro.sample("g", BernoulliGates(probs.logit()).to_event(1))

    with pytest.raises(NotImplementedError):  # else this would test the analytic KL
        torch.distributions.kl_divergence(BernoulliGates(probs.logit()),
                                          pyro.distributions.Binomial(1, rho.expand(rows, k)))
    pyro.set_rng_seed(0)
    with pyro.validation_enabled(False):
        mc = MeanFieldELBO().terms(model, poutine.reparam(guide, config={"g": Draw(kl_clamp=0.0)})).kl
    on, off = (probs / rho).log(), ((1 - probs) / (1 - rho)).log()  # log q - log p with the gate on, off
    exact = probs * on + (1 - probs) * off
    variance = probs * on ** 2 + (1 - probs) * off ** 2 - exact ** 2
    assert abs(mc - exact.sum()) < 4 * variance.sum().sqrt()
    assert abs(mc - exact.sum()) > 1e-3  # a draw, not the analytic KL


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


@pytest.mark.parametrize("prior", ["bernoulli", "beta-bernoulli"])
@pytest.mark.parametrize("gate", sorted(GATES))
def test_svi_the_elbo_and_the_trainer_train_one_objective(gate, prior):
    """For every estimator, on a small batch: Pyro's SVI with the estimator's ELBO (its ``loss_and_grads``, which
    ``SVI.step`` runs, and the loss ``SVI.step`` returns), the ELBO's ``differentiable_loss`` and the head's training
    step (the trainer's loss, -ELBO / 2N) give the same loss and the same gradients: leg's head gradient included."""
    cfg = resolve(Config(dataset="digits", prior=prior, gate=gate, proj_hidden=32, proj_dim=16, kl_weight=0.05))
    learner = ContrastiveLearner(cfg, in_channels=1, num_train=100)
    head, x = learner.head, torch.randn(12, 1, 8, 8)
    model, guide = head.training_program()
    elbo = head.estimator.elbo()

    def svi_model(z, h):
        pyro.module("learner", learner)  # SVI trains the parameters the program's param sites name
        return model(z, h)

    losses, grads = {}, {}
    with pyro.validation_enabled(False):
        for way in ("trainer", "differentiable_loss", "svi", "svi.step"):
            learner.zero_grad()
            pyro.set_rng_seed(3)
            if way == "trainer":
                loss, _ = learner(x)
                loss.backward()
            else:
                h = learner.backbone(x)
                z = head.projector(h)
                with own_params():
                    if way == "differentiable_loss":
                        loss = elbo.differentiable_loss(model, guide, z, h)
                        loss.backward()
                    elif way == "svi":
                        loss = elbo.loss_and_grads(svi_model, guide, z, h)
                    else:
                        loss = SVI(svi_model, guide, pyro.optim.SGD({"lr": 0.0}), elbo).step(z, h)
                loss = torch.as_tensor(loss) / head.num_rows
            losses[way] = loss.detach()
            grads[way] = {n: p.grad.clone() for n, p in learner.named_parameters() if p.grad is not None}
    for way in ("differentiable_loss", "svi", "svi.step"):
        torch.testing.assert_close(losses[way], losses["trainer"], msg=way)
    assert grads["svi"].keys() == grads["trainer"].keys()
    assert any(n.startswith("head.guide.head.") for n in grads["svi"])
    for name, grad in grads["trainer"].items():
        for way in ("differentiable_loss", "svi"):
            torch.testing.assert_close(grads[way][name] / head.num_rows, grad, msg=f"{way}: {name}")


@pytest.mark.parametrize("gate", ["ste", "gs"])
def test_predictive_draws_the_gates_from_the_q_that_training_uses(gate):
    """Pyro's Predictive on the head's program as written (no estimator: the gate site is discrete) draws g from
    q(g | x), the family the estimator trains: each gate's share of open draws is its inclusion probability, within
    4.5 standard errors (80 gates)."""
    torch.manual_seed(0)
    head = BayesNCLHead(6, 8, 16, num_train=100, gate=gate)
    h = torch.randn(10, 6)
    model, guide = head.program()
    draws = 1000
    with own_params(), torch.no_grad(), pyro.validation_enabled(False):
        g = Predictive(model, guide=guide, num_samples=draws, return_sites=["g"])(head.projector(h), h)["g"]
    p = head.gate_probs(h).detach()
    assert g.shape == (draws, 10, 8) and ((g == 0) | (g == 1)).all()
    assert ((g.mean(0) - p).abs() < 4.5 * (p * (1 - p) / draws).sqrt()).all()


@pytest.mark.parametrize("prior", ["bernoulli", "beta-bernoulli"])
def test_svi_on_the_heads_svi_program_trains_the_head_as_the_trainer_does(prior):
    """``SVI(*head.svi_program(), optim, head.elbo())`` steps the projector, the gating head and the prior with the
    head's own loss (x 2N) and gradients; a bare SVI on the training program steps nothing of the head for the
    bernoulli prior, whose program names no param site (the reason svi_program exists)."""
    torch.manual_seed(0)
    head, h = BayesNCLHead(6, 8, 16, num_train=100, prior=prior, kl_weight=0.05), torch.randn(10, 6)
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    pyro.set_rng_seed(3)
    expected, _ = head(h)
    expected.backward()
    grads = {n: p.grad.clone() for n, p in head.named_parameters()}
    head.zero_grad()
    with pyro.validation_enabled(False), own_params():
        pyro.set_rng_seed(3)
        loss = SVI(*head.svi_program(), pyro.optim.SGD({"lr": 0.5}), head.elbo()).step(h)
    assert loss / head.num_rows == pytest.approx(expected.item(), rel=1e-6)
    for n, p in head.named_parameters():
        assert not torch.equal(p, before[n]), n
        # -ELBO's gradient against N x the head's loss's: equal up to float32 rounding, scaled by the step
        torch.testing.assert_close(p.detach(), before[n] - 0.5 * grads[n] * head.num_rows, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{n}: {m}")
    if prior == "bernoulli":
        trained = {n: p.detach().clone() for n, p in head.named_parameters()}
        model, guide = head.training_program()
        with pyro.validation_enabled(False), own_params():
            SVI(model, guide, pyro.optim.SGD({"lr": 0.5}), head.elbo()).step(head.projector(h), h)
        assert all(torch.equal(p, trained[n]) for n, p in head.named_parameters())


def _summed(model_trace, guide_trace):
    """MeanFieldELBO's -ELBO of one particle (at the registered KL: no clamp) and its KL part."""
    particle = MeanFieldELBO().particle(model_trace, guide_trace)
    return particle.loss, sum(particle.site_kl.values()) if particle.site_kl else 0.0


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
    for particle in (_summed, _negated_elbo):
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


def test_leg_finds_the_gates_by_the_programs_mark_whatever_the_sites_are_called():
    """leg's ELBO reads the gate site and the InfoNCE factor by what the program marks, not by their names: under
    ``pyro.contrib.autoname.scope`` (every site renamed ``mine/...``) it gives the same loss and the same gradient in
    the gating head as on the program's own names."""
    from pyro.contrib.autoname import scope

    torch.manual_seed(0)
    head = BayesNCLHead(12, 8, 16, num_train=50, prior="bernoulli", prior_prob=0.3, kl_weight=1e-3, gate="leg")
    h = torch.randn(10, 12)
    z = head.projector(h).detach()
    model, guide = head.training_program()
    params = list(head.guide.head.parameters())
    results = []
    for wrap in (lambda fn: fn, lambda fn: scope(fn, prefix="mine")):
        torch.manual_seed(1)
        with own_params():
            terms = head.elbo().terms(wrap(model), wrap(guide), z, h)
        assert ("mine/g" in terms.model_trace.nodes) == (len(results) == 1)
        results.append((terms.loss, torch.autograd.grad(terms.loss, params)))
    (loss, grads), (scoped_loss, scoped_grads) = results
    assert scoped_loss.item() == pytest.approx(loss.item(), rel=1e-6)
    for a, b in zip(grads, scoped_grads, strict=True):
        torch.testing.assert_close(a, b)
    assert any(g.abs().sum() > 0 for g in grads)
