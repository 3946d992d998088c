import itertools
import logging
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.autoguide import AutoNormal

from bayesncl_pyro import BayesNCLHead
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.infer.estimators import GATES
from bayesncl_pyro.infer.kl import ANALYTIC, ENUMERATED, LOCAL_EXPECTATION, PATHWISE, site_kl
from bayesncl_pyro.models.priors import BernoulliPrior, Prior

D, K, H, R = 6, 8, 16, 10


class BinomialGates(Prior):
    """Bernoulli(rho) gates in law, written as Binomial(1, rho): no KL against q is registered, p factorises."""

    def forward(self, rows):
        return dist.Binomial(1, torch.full((rows, self.num_features), self.prior_prob)).to_event(1)


class OneComponentMixture(Prior):
    """Bernoulli(rho) gates in law, written as a mixture of one component: a law over a row's K gates jointly."""

    def forward(self, rows):
        rates = torch.full((rows, 1, self.num_features), self.prior_prob)
        return dist.MixtureSameFamily(dist.Categorical(torch.ones(rows, 1)), dist.Bernoulli(rates).to_event(1))


def _mean_head_grad(prior, gate, draws):
    """The gating head's first-layer gradient, mean over ``draws`` steps of one head, the same seeds for any prior."""
    torch.manual_seed(0)
    head = BayesNCLHead(D, K, H, num_train=100, prior=prior, gate=gate, kl_weight=1.0, kl_clamp=0.0)
    h = torch.randn(R, D)
    total = torch.zeros_like(head.guide.head[0].weight)
    for seed in range(draws):
        head.zero_grad()
        pyro.set_rng_seed(seed)
        with pyro.validation_enabled(False):
            head(h)[0].backward()
        total += head.guide.head[0].weight.grad
    return total / draws, head


# ste (the default) and leg (unbiased) in the default run; every other estimator with the slow checks
@pytest.mark.parametrize("gate", [g if g in ("ste", "leg") else pytest.param(g, marks=pytest.mark.slow) for g in GATES])
def test_a_same_law_prior_without_a_registered_kl_trains_the_analytic_priors_gradient(gate):
    """For every estimator: the prior written as Binomial(1, rho) (enumerated per gate, exact) gives the analytic
    Bernoulli prior's gating-head gradient to float precision; written as a one-component mixture (a joint law: one
    draw, the local expectation gradient) its mean over 200 draws is within cosine 0.95 and 10 % in norm. The one-draw
    log q - log p this replaces gave cosine -0.10 under leg and the wrong sign on a gate under ste."""
    analytic, head = _mean_head_grad(BernoulliPrior(K, 0.7), gate, 200)
    assert head.kl_kind == {"g": ANALYTIC}
    enumerated, head = _mean_head_grad(BinomialGates(K, 0.7), gate, 5)
    assert head.kl_kind == {"g": ENUMERATED}
    torch.testing.assert_close(enumerated, _mean_head_grad(BernoulliPrior(K, 0.7), gate, 5)[0], rtol=1e-4, atol=1e-6)
    joint, head = _mean_head_grad(OneComponentMixture(K, 0.7), gate, 200)
    assert head.kl_kind == {"g": LOCAL_EXPECTATION}
    cosine = torch.nn.functional.cosine_similarity(joint.flatten(), analytic.flatten(), dim=0)
    assert cosine >= 0.95, cosine
    assert abs(joint.norm() / analytic.norm() - 1) <= 0.10


def _correlated(weights, batch=()):
    """A law over a row's 4 gates that couples them: a mixture of two product-Bernoulli components, for 3 rows."""
    rates = torch.tensor([[0.9, 0.8, 0.1, 0.2], [0.1, 0.3, 0.9, 0.7]]).expand(*batch, 3, 2, 4)
    mixing = dist.Categorical(logits=weights.expand(*batch, 3, 2))
    return dist.MixtureSameFamily(mixing, dist.Bernoulli(rates).to_event(1))


def test_the_kl_of_correlated_gates_and_its_gradients_match_exact_enumeration():
    """R = 3 rows of K = 4 gates against a prior that couples them (no KL registered, no factorisation): over
    4,000 draws (one batch) the estimate's mean value is the exact KL (summed over the 16 configurations of each row)
    within four standard errors, and its mean gradients on q's logits and on the prior's own parameter match the
    exact ones."""
    logits = torch.tensor([[1.0, -0.5, 0.3, -2.0], [0.2, 0.1, -1.0, 1.5], [-0.3, 2.0, 0.0, 0.4]], requires_grad=True)
    weights = torch.tensor([0.3, -0.2], requires_grad=True)
    configs = torch.tensor(list(itertools.product([0.0, 1.0], repeat=4)))  # 16 x 4
    log_q = dist.Bernoulli(logits=logits).to_event(1).log_prob(configs[:, None])  # 16 x 3
    exact = (log_q.exp() * (log_q - _correlated(weights).log_prob(configs[:, None]))).sum()
    exact_grads = torch.autograd.grad(exact, (logits, weights))
    draws = 4000
    torch.manual_seed(0)
    q = dist.Bernoulli(logits=logits.expand(draws, 3, 4)).to_event(1)
    term, kind = site_kl(q, _correlated(weights, (draws,)), None, kl_clamp=0.0)
    assert kind == LOCAL_EXPECTATION and term.shape == (draws, 3)
    values = term.detach().sum(-1)
    assert abs(values.mean() - exact.detach()) < 4 * values.std() / draws ** 0.5
    grads = torch.autograd.grad(term.sum(-1).mean(), (logits, weights))
    for got, want in zip(grads, exact_grads):
        torch.testing.assert_close(got, want, atol=0.02, rtol=0.05)


class _Rate(Prior):
    """A rate per gate with a Beta hyperprior, its guide written by hand."""

    def rate(self):
        return pyro.sample("rate", dist.Beta(torch.full((self.num_features,), 8.0), 2.0).to_event(1))


class _GuideWithoutToEvent(_Rate):
    def make_guide(self):
        return _BatchGuide(self.num_features)


class _BatchGuide(pyro.nn.PyroModule):
    def __init__(self, k):
        super().__init__()
        self.k = k

    def forward(self):
        return pyro.sample("rate", dist.Beta(torch.full((self.k,), 5.0), 5.0))  # batch shape K, no event dim


def test_a_guide_missing_to_event_is_refused_by_pyros_own_check_in_one_line():
    """Its KL became a one-draw estimate without a word; now Pyro's check_model_guide_match names the site."""
    with pytest.raises(UserError, match=r"_GuideWithoutToEvent's guide does not fit its prior .*'rate'.* event shape "
                                        r"\(8,\), the guide Beta with event shape \(\); give the guide's distribution "
                                        r"the prior's event dimensions \(.to_event\(n\)\)"):
        BayesNCLHead(D, K, H, num_train=100, prior=_GuideWithoutToEvent(K, 0.8))


def test_a_prior_without_a_guide_gets_pyros_autonormal_and_trains(caplog):
    """No make_guide: the default guide is an AutoNormal over the prior's latents; the head says once, per site, how
    each KL is taken (at DEBUG: run_svi.py prints it in its first lines); the rate's q moves with training."""
    with caplog.at_level(logging.DEBUG, logger="bayesncl_pyro.infer.head"):
        head = BayesNCLHead(D, K, H, num_train=100, prior=_Rate(K, 0.8), kl_weight=0.1)
    assert isinstance(head.guide.rate_guide, AutoNormal)
    assert head.kl_kind == {"rate": PATHWISE, "rate_unconstrained": PATHWISE, "g": ANALYTIC}
    said = [r.getMessage() for r in caplog.records if "KL of latent site" in r.getMessage()]
    assert said == [f"the KL of latent site {site!r}: {kind}" for site, kind in head.kl_kind.items()]
    before = head.guide.rate_guide.locs.rate.detach().clone()
    optimizer = torch.optim.SGD(head.param_groups(lr=0.1), lr=0.1)
    for seed in range(3):
        pyro.set_rng_seed(seed)
        loss, _ = head(torch.randn(R, D))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert torch.isfinite(loss) and not torch.equal(head.guide.rate_guide.locs.rate, before)
    # the rate's two terms are log q(v) - log p(v) of q's density at its draw v, the Jacobian of the sigmoid included
    # (Pyro's registered KL(Delta || p) would drop it)
    with torch.no_grad():
        terms = head.elbo_terms(head.projector(torch.randn(R, D)), torch.randn(R, D))
    v = terms.guide_trace.nodes["rate"]["value"]
    auto = head.guide.rate_guide
    q_v = dist.TransformedDistribution(dist.Normal(auto.locs.rate, auto.scales.rate),
                                       torch.distributions.transforms.SigmoidTransform()).to_event(1)
    want = 0.1 * (q_v.log_prob(v) - dist.Beta(torch.full((K,), 8.0), 2.0).to_event(1).log_prob(v))
    torch.testing.assert_close(terms.site_kl["rate"] + terms.site_kl["rate_unconstrained"], want)


class _SlabIndicator(Prior):
    """A discrete global latent: whether every gate's rate is high or low."""

    def rate(self):
        slab = pyro.sample("slab", dist.Bernoulli(0.5))
        return (0.2 + 0.6 * slab).expand(self.num_features)


def test_a_discrete_latent_is_refused_when_the_head_is_built_naming_site_and_remedy():
    """It failed at step 1 with 'train with pyro.infer.TraceGraph_ELBO', which a head user does not choose."""
    with pytest.raises(UserError, match=r"_SlabIndicator samples the discrete latent 'slab' \(Bernoulli\).*sum it out "
                                        r"in forward\(\) .*MixtureSameFamily"):
        BayesNCLHead(D, K, H, num_train=100, prior=_SlabIndicator(K, 0.8))


def test_the_elbo_returns_what_it_computed_and_writes_nothing_into_the_traces():
    """leg's probabilities and each site's KL come back in the ELBO's terms; nothing is stashed in the traces."""
    torch.manual_seed(0)
    head = BayesNCLHead(D, K, H, num_train=100, prior="beta-bernoulli", gate="leg", kl_weight=0.1)
    h = torch.randn(R, D)
    terms = head.elbo_terms(head.projector(h), h)
    assert terms.gate_probs is not None and terms.gate_probs.requires_grad
    assert set(terms.site_kl) == {"rate", "g"}
    torch.testing.assert_close(sum(terms.site_kl.values()), terms.kl * head.num_rows * 0.1)
    for trace in (terms.model_trace, terms.guide_trace):
        for site in trace.nodes.values():
            assert "kl" not in site and "local_expectation_probs" not in site.get("infer", {})


def test_no_file_of_infer_holds_more_than_one_idea_worth_400_lines():
    infer = Path(__file__).resolve().parents[2] / "bayesncl_pyro" / "infer"
    sizes = {p.name: len(p.read_text().splitlines()) for p in infer.glob("*.py")}
    assert max(sizes.values()) <= 400, sizes


def test_a_mixture_of_bernoulli_products_flips_every_gate_in_one_pass():
    """Its K flipped log-densities from its components equal the mixture's log_prob at each flipped draw (the generic
    path: K evaluations), and the local expectation KL is the same either way."""
    from torch.distributions import Bernoulli, Categorical, Independent, MixtureSameFamily

    from bayesncl_pyro.infer import kl as kl_module

    torch.manual_seed(0)
    rates = torch.rand(6, 3, 9) * 0.8 + 0.1
    p = MixtureSameFamily(Categorical(logits=torch.randn(6, 3)), Independent(Bernoulli(probs=rates), 1))
    b = torch.bernoulli(torch.full((6, 9), 0.4))
    fast = kl_module._flipped_log_probs(p, b)
    eye = torch.eye(9)
    slow = torch.stack([p.log_prob((b - eye[k]).abs()) for k in range(9)])
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    assert kl_module._mixture_flips(Independent(Bernoulli(probs=rates[:, 0]), 1), b) is None  # another law: generic


class _ChainGates(torch.distributions.Distribution):
    """Neighbouring gates coupled (gate k's logit moved by gate k - 1), with its flips given by a method of its own."""

    arg_constraints = {}

    def __init__(self, bias, weight, flips=True, shape_error=False):
        self.bias, self.weight, self.calls, self.shape_error = bias, weight, 0, shape_error
        if flips:
            self.flip_log_probs = self._flips
        super().__init__(bias.shape[:-1], bias.shape[-1:], validate_args=False)

    def _logits(self, value):
        return self.bias + self.weight * torch.nn.functional.pad(value[..., :-1], (1, 0))

    def log_prob(self, value):
        logits = self._logits(value)
        return (value * logits - torch.nn.functional.softplus(logits)).sum(-1)

    def _flips(self, b):
        self.calls += 1
        logits, sign = self._logits(b), 1 - 2 * b
        moved = logits[..., 1:] + sign[..., :-1] * self.weight[1:]
        following = (b[..., 1:] * (moved - logits[..., 1:]) - torch.nn.functional.softplus(moved)
                     + torch.nn.functional.softplus(logits[..., 1:]))
        flips = (self.log_prob(b).unsqueeze(-1) + sign * logits + torch.nn.functional.pad(following, (0, 1)))
        return flips if self.shape_error else flips.movedim(-1, 0)


def test_a_law_that_gives_its_own_flips_is_used_and_a_wrong_shape_is_one_clear_error():
    """A coupled law with ``flip_log_probs`` gets the local expectation KL through it, with the value and gradient
    the K evaluations of its log-density give; flips of the wrong shape are refused, naming the shape wanted."""
    torch.manual_seed(0)
    bias, weight = torch.randn(6, 9), 2 * torch.randn(9)
    logits = torch.randn(6, 9, requires_grad=True)
    results = []
    for flips in (True, False):
        p = _ChainGates(bias, weight, flips=flips)
        torch.manual_seed(1)
        q = torch.distributions.Independent(torch.distributions.Bernoulli(logits=logits), 1)
        kl, kind = site_kl(q, p, None, kl_clamp=None)
        assert kind == LOCAL_EXPECTATION and p.calls == int(flips)
        results.append((kl, torch.autograd.grad(kl.sum(), logits)[0]))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-6)
    with pytest.raises(UserError, match=r"flip_log_probs\(b\) gave \(6, 9\).*K x rows = \(9, 6\)"):
        torch.manual_seed(1)
        site_kl(q, _ChainGates(bias, weight, shape_error=True), None, kl_clamp=None)
