"""Priors a new user writes: each builds and trains, or is refused when the head is built in one line naming the fix."""

import math

import pyro.distributions as dist
import pytest
import torch
from torch.distributions import constraints

from bayesncl_pyro import BayesNCLHead
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.models.priors import LogitNormalPrior, Prior, gate_rates


class _TwoRegimes(dist.TorchDistribution):
    """A mixture of two sparsity regimes over a row's K gates, written as its own distribution: no ``mean``."""

    arg_constraints = {}
    support = constraints.independent(constraints.boolean, 1)

    def __init__(self, rows: int, k: int, low: float = 0.1, high: float = 0.7):
        self.k, self.low, self.high = k, low, high
        super().__init__(torch.Size([rows]), torch.Size([k]))

    def log_prob(self, value):
        def one(rate):
            return (value * math.log(rate) + (1 - value) * math.log(1 - rate)).sum(-1)
        return torch.logsumexp(torch.stack([one(self.low), one(self.high)]), 0) - math.log(2)

    def sample(self, sample_shape=torch.Size()):
        shape = self._extended_shape(sample_shape)
        high = torch.rand(shape[:-1] + (1,)) < 0.5
        return (torch.rand(shape) < torch.where(high, self.high, self.low)).float()


class _TwoRegimePrior(Prior):
    def forward(self, rows):
        return _TwoRegimes(rows, self.num_features)


def test_a_coupled_prior_without_a_mean_trains_and_logs_its_pull():
    """Its head's prior pull and rates came from ``prior.mean``: an empty NotImplementedError at the first log step.
    The rates now come from draws where the distribution has no mean (their mean, 0.4 per gate)."""
    torch.manual_seed(0)
    head = BayesNCLHead(6, 8, 16, num_train=100, prior=_TwoRegimePrior(8, 0.4), kl_weight=0.1)
    loss, out = head(torch.randn(10, 6))
    loss.backward()
    pulls = head.pulls(out)
    assert set(pulls) == {"gate_nce_pull", "gate_prior_pull"} and math.isfinite(pulls["gate_prior_pull"])
    torch.testing.assert_close(out.prior_rate, torch.full((8,), 0.4), atol=0.08, rtol=0)
    assert head.model.prior.mean_rate().shape == (8,)
    state = torch.get_rng_state()
    gate_rates(_TwoRegimes(3, 8))
    assert torch.equal(torch.get_rng_state(), state)  # the draws come from a forked stream


def test_the_logit_normal_prior_at_a_wide_scale_is_built_whatever_the_seed():
    """At scale 5 a logit draw above 17 has a float32 sigmoid of exactly 1, and the rate check refused the prior at
    random (3 of 20 seeds at K 256); rates of exactly 0 or 1 are now clamped into (0, 1)."""
    for seed in range(20):
        torch.manual_seed(seed)
        head = BayesNCLHead(6, 256, 16, num_train=100, prior=LogitNormalPrior(256, 0.2, scale=5.0))
        p = head.model.prior(4)
        assert ((p.base_dist.probs > 0) & (p.base_dist.probs < 1)).all()


class _Horseshoe(Prior):
    """A horseshoe on the gates' logits: heavy tails, so some logits' sigmoids round to exactly 0 or 1."""

    def rate(self):
        import pyro

        scale = pyro.sample("tau", dist.HalfCauchy(torch.ones(self.num_features)).to_event(1))
        return pyro.sample("logit", dist.Normal(0.0, 30 * scale).to_event(1)).sigmoid()


def test_a_horseshoe_on_the_logits_is_built_and_trains():
    torch.manual_seed(3)
    head = BayesNCLHead(6, 64, 16, num_train=100, prior=_Horseshoe(64, 0.5), kl_weight=0.1)
    loss, _ = head(torch.randn(10, 6))
    loss.backward()
    assert torch.isfinite(loss)


class _NoSuper(Prior):
    def __init__(self, num_features, prior_prob=0.2):
        self.k = num_features

    def rate(self):
        return torch.full((self.k,), 0.2)


def test_a_prior_that_skips_super_init_is_one_line():
    with pytest.raises(UserError, match=r"_NoSuper.__init__ did not call super\(\).__init__\(num_features, "
                                        r"prior_prob\)") as e:
        BayesNCLHead(6, 8, 16, num_train=100, prior=_NoSuper(8))
    assert "\n" not in str(e.value)


def test_a_learned_prior_called_outside_a_head_keeps_its_parameters_its_own():
    """Called outside a head (a notebook's pattern), a learned prior's parameter entered Pyro's global param store, and
    a second prior of that class took the first one's through it (then was refused as another head's)."""
    import pyro

    from bayesncl_pyro.models.priors import LearnedPrior

    first, second = LearnedPrior(4, 0.2), LearnedPrior(4, 0.9)
    torch.testing.assert_close(first(1).mean, torch.full((1, 4), 0.2))
    torch.testing.assert_close(second(1).mean, torch.full((1, 4), 0.9))
    assert first.logit_rate_unconstrained is not second.logit_rate_unconstrained
    assert len(pyro.get_param_store().keys()) == 2  # each under a name of its own
    head = BayesNCLHead(6, 4, 16, num_train=100, prior=second, kl_weight=0.1)
    head(torch.randn(10, 6))[0].backward()
    assert second.logit_rate_unconstrained.grad is not None


class _LearnedMixture(Prior):
    """Two sparsity regimes whose weights are learned (a plain parameter of the prior's own)."""

    def __init__(self, num_features, prior_prob=0.3):
        super().__init__(num_features, prior_prob)
        self.weight_logits = torch.nn.Parameter(torch.tensor([0.3, -0.3]))

    def forward(self, rows):
        rates = torch.tensor([[0.1], [0.6]]).expand(2, self.num_features)
        mixture = dist.MixtureSameFamily(dist.Categorical(logits=self.weight_logits),
                                         dist.Bernoulli(probs=rates).to_event(1))
        return mixture.expand([rows])


def test_gates_nc_holds_the_priors_own_learned_parameters():
    """gates.nc held the guide's parameters of global latents but not the prior's own (a mixture's weights, the
    learned prior's rates): they are prior_param_<name>, a PyroParam in its constrained space."""
    from bayesncl_pyro.evaluate.arviz_export import to_datatree
    from bayesncl_pyro.evaluate.posterior import GatePosterior, learned_parameters
    from bayesncl_pyro.models.priors import LearnedPrior

    learned = LearnedPrior(4, 0.2)
    params = learned_parameters(learned)
    torch.testing.assert_close(params["logit_rate"], torch.full((4,), 0.2).logit())
    mixture = _LearnedMixture(4)
    assert set(learned_parameters(mixture)) == {"weight_logits"}
    post = GatePosterior(torch.rand(3, 4), torch.rand(3, 4), torch.zeros(3, dtype=torch.long), ["x"],
                         draws=torch.ones(2, 3, 4), prior_params={**params, **learned_parameters(mixture)})
    gates = to_datatree(post)["gates"]
    assert gates["prior_param_logit_rate"].dims == ("feature",)
    assert gates["prior_param_weight_logits"].values.tolist() == pytest.approx([0.3, -0.3])
