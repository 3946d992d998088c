"""The unbiased gate gradient of the bias diagnostic: its flip differences and its identity, checked by brute
force and exact enumeration; the diagnostic itself on a small learner."""

import itertools

import pyro
import pyro.distributions as dist
import pytest
import torch

from bayesncl_pyro.config import Config
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.infer.estimators import GATES
from bayesncl_pyro.infer.gate_gradients import SCORE, gate_gradient_bias, unbiased_gradient
from bayesncl_pyro.infer.learner import ContrastiveLearner
from bayesncl_pyro.models.priors import Prior
from bayesncl_pyro.nn.losses import bernoulli_kl, info_nce_flip_differences, info_nce_rows, normalize
from bayesncl_pyro.train.resolve import resolve


def _total(features, gates, tau):
    return info_nce_rows(normalize(features.double() * gates.double()), tau).sum()


@pytest.mark.parametrize("signed", [False, True])
def test_flip_differences_equal_recomputing_the_loss(signed):
    """Every gate's difference against recomputing the batch's InfoNCE with it on and off: non-negative features
    (NCL's) and signed ones (a head built with nonneg="none"), zero rows and rows whose gates all close."""
    torch.manual_seed(0)
    features = (torch.randn(8, 5) if signed else torch.rand(8, 5)) * (torch.rand(8, 5) > 0.3)
    features[3] = 0.0  # a row with no feature at all
    gates = (torch.rand(8, 5) > 0.4).float()
    gates[5] = 0.0  # a row whose gates are all closed: flipping one opens it
    gates[6] = torch.tensor([1.0, 0, 0, 0, 0])  # and one whose last open gate closes
    d = info_nce_flip_differences(features.double(), gates, 0.3)
    for i, k in itertools.product(range(8), range(5)):
        on, off = gates.clone(), gates.clone()
        on[i, k], off[i, k] = 1.0, 0.0
        expected = _total(features, on, 0.3) - _total(features, off, 0.3)
        torch.testing.assert_close(d[i, k], expected, rtol=1e-9, atol=1e-10, msg=f"gate ({i}, {k})")


@pytest.mark.parametrize("name", ["ste", "gs"])
def test_the_unbiased_gradient_is_exact_on_enumeration(name):
    """d E_q[sum_i l_i] / d logit_ik = p_ik' E_q[D_ik], both sides exact over all 2^8 gate configurations."""
    torch.manual_seed(1)
    rows, dims, tau = 4, 2, 0.5
    features = torch.rand(rows, dims, dtype=torch.float64) + 0.1
    logits = torch.randn(rows, dims, dtype=torch.float64, requires_grad=True)
    q = GATES[name].family(logits)
    configs = torch.tensor(list(itertools.product([0.0, 1.0], repeat=rows * dims)), dtype=torch.float64)
    configs = configs.view(-1, rows, dims)
    weights = torch.stack([q.log_prob(c).sum().exp() for c in configs])
    expected, = torch.autograd.grad((weights * torch.stack([_total(features, c, tau) for c in configs])).sum(), logits)
    mean_d = sum(w.detach() * info_nce_flip_differences(features, c, tau) for w, c in zip(weights, configs))
    dprob, = torch.autograd.grad(GATES[name].family.inclusion(logits).sum(), logits)
    torch.testing.assert_close(dprob * mean_d, expected)


def test_unbiased_gradient_matches_enumeration_in_scale_and_direction():
    """The diagnostic's reference, loss per row and KL included, against the exact gradient of
    E_q[mean_i l_i] + lambda * mean_i sum_k KL_ik over all 2^8 gate configurations."""
    torch.manual_seed(2)
    rows, dims, tau, lam, rate = 4, 2, 0.5, 0.2, torch.tensor([0.6, 0.3])
    features = torch.rand(rows, dims, dtype=torch.float64) + 0.1
    logits = torch.randn(rows, dims, dtype=torch.float64, requires_grad=True)
    gate = GATES["relaxed"].family
    q = gate(logits)
    configs = torch.tensor(list(itertools.product([0.0, 1.0], repeat=rows * dims)), dtype=torch.float64)
    nce = sum(q.log_prob(c).sum().exp() * _total(features, c, tau) for c in configs.view(-1, rows, dims)) / rows
    kl = lam * bernoulli_kl(q.probs, rate.double(), 0.0).sum() / rows
    expected, = torch.autograd.grad(nce + kl, logits)
    draws = unbiased_gradient(features, logits, gate, rate, lam, 0.0, tau, 4000)
    assert draws.shape == (4000, rows, dims)
    torch.testing.assert_close(draws.mean(0), expected, rtol=0, atol=4 * draws.std(0).max().item() / 4000**0.5)


def _learner(**kw):
    torch.manual_seed(0)
    cfg = resolve(Config(dataset="digits", proj_hidden=32, proj_dim=8, **kw))
    return ContrastiveLearner(cfg, in_channels=1, num_train=200)


def test_where_the_exact_kl_dominates_every_honest_estimator_agrees_with_the_reference():
    """With lambda large the exact KL gradient, shared by the reference and every estimator but
    gs-reference-kl, outweighs InfoNCE's: the cosines go to 1 (this checks the reference's scaling against the
    training loss), and the reference's KL at sigmoid(logits) shows as a bias."""
    learner = _learner(kl_weight=100.0, logit_bound=2.0)
    x = torch.randn(16, 1, 8, 8)
    results = {r["estimator"]: r for r in gate_gradient_bias(learner, x, draws=4, reference_draws=4)}
    assert list(results) == [*GATES, SCORE] and results["ste"]["draws"] == 1 and results["relaxed"]["draws"] == 4
    for name in ("ste", "relaxed", "leg", "gs"):
        assert results[name]["cosine"] > 0.999 and results[name]["relative_error"] < 0.05, results[name]
    assert results["st-sampled"]["cosine"] > 0.99  # its straight-through term is the noisiest at 4 draws
    assert results["gs-reference-kl"]["relative_error"] > 0.1
    assert type(learner.head.estimator) is GATES["ste"] and learner.guide.family is GATES["ste"].family
    assert learner.training  # put back as it was (a new learner trains)


def test_the_diagnostic_refuses_what_it_cannot_measure():
    x = torch.randn(8, 1, 8, 8)
    with pytest.raises(UserError, match="no gates"):
        gate_gradient_bias(_learner(method="ncl"), x)


class _TwoRegimes(Prior):
    """A coupled prior of the user's, without a registry name: a row's gates all at one of two rates."""

    def forward(self, rows):
        mix = dist.Categorical(torch.tensor([0.5, 0.5]))
        rates = torch.tensor([[0.1], [0.7]]).expand(2, self.num_features)
        gates = dist.Independent(dist.Bernoulli(probs=rates), 1)
        return dist.MixtureSameFamily(mix, gates).expand([rows])


@pytest.mark.parametrize("prior", ["beta-bernoulli", "ibp", "per-image", _TwoRegimes])
def test_the_diagnostic_measures_priors_coupled_or_with_latents_of_their_own(prior):
    """It refused a coupled prior of the user's (neither rate() nor forward(rows) read) and one with global latents
    (and crashed reading the registry name a user's prior has not). With lambda large the KL's gradient, taken as the
    head takes it (at a fresh draw of the prior's latents; per gate by local expectation for the coupled prior),
    dominates, and leg, which trains on the same KL, agrees with the reference."""
    torch.manual_seed(0)
    cfg = dict(kl_weight=30.0, logit_bound=2.0, prior_prob=0.3)
    learner = _learner(prior=prior if isinstance(prior, str) else "bernoulli", **cfg)
    if not isinstance(prior, str):  # the user's prior, of no parameters, in the bernoulli prior's place
        learner.head.model.prior = prior(8, 0.3)
    x = torch.randn(16, 1, 8, 8)
    result, = gate_gradient_bias(learner, x, ("leg",), draws=64, reference_draws=64)
    assert result["cosine"] > 0.95, result


def test_two_learned_priors_in_one_process_keep_their_own_rates():
    """The diagnostic runs the head's program, inside the head's own param scope: nothing is left in Pyro's global
    param store, where the next learner of the process would pick up the previous one's prior rate (the conftest
    clears the store only between tests)."""
    first, second = (ContrastiveLearner(resolve(Config(dataset="digits", proj_hidden=32, proj_dim=8, prior="learned",
                                                       prior_prob=rho)), 1, 200) for rho in (0.2, 0.9))
    x = torch.randn(16, 1, 8, 8)
    for learner, rho in ((first, 0.2), (second, 0.9)):
        for validation in (False, True):
            with pyro.validation_enabled(validation):
                gate_gradient_bias(learner, x, ("ste",), draws=1, reference_draws=2)
                learner(x)
            assert not list(pyro.get_param_store().keys())
        torch.testing.assert_close(learner.model.prior.rate().detach(), torch.full((8,), rho))
    assert second.model.prior.logit_rate_unconstrained is not first.model.prior.logit_rate_unconstrained
