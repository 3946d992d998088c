"""Each gate estimator reports the probability its gates are on, the KL says what it computes, and the
package registers its KL for its own gate classes only."""

import json
import subprocess
import sys

import pyro.distributions as dist
import pytest
import torch

from bayesncl_pyro.errors import UserError
from bayesncl_pyro.guides.gates import GATES, GateGuide, GumbelSigmoidGate, gate_class
from bayesncl_pyro.losses import bernoulli_kl

LOGITS = torch.linspace(-5, 5, 21)  # the range the guide's logit bound allows
DRAWS = 100_000


def _within_three_standard_errors(draws: torch.Tensor, probs: torch.Tensor):
    freq = draws.double().mean(0)
    se = (probs.double() * (1 - probs.double()) / draws.shape[0]).sqrt()
    assert ((freq - probs).abs() <= 3 * se).all(), (freq - probs) / se


@pytest.mark.parametrize("name", list(GATES))
def test_reported_probability_is_the_frequency_of_open_gates(name):
    """q(g = 1 | x) as every consumer reads it (``probs``) against 100,000 gates: the draws from q
    (``sample``, what gates.nc holds) for every estimator, and the value training uses (``rsample``) for
    the sampled ones; the ``ste`` training value is the mode of q."""
    q = GATES[name](LOGITS, temperature=0.5)
    torch.testing.assert_close(q.probs, GATES[name].inclusion(LOGITS))
    _within_three_standard_errors(q.sample((DRAWS,)), q.probs)
    trained = q.rsample((DRAWS,))
    assert set(trained.unique().tolist()) <= {0.0, 1.0}
    if name == "ste":
        assert torch.equal(trained, (q.probs > 0.5).float().expand_as(trained))
    else:
        _within_three_standard_errors(trained, q.probs)


def test_gs_probability_is_not_the_sigmoid_and_is_exact_on_the_float32_grid():
    """The reference's Gumbel: 0.632 at logit 0 where the sigmoid says 0.5, always on past logit 2.2204.
    Against every value torch.rand can return in float32 (k / 2^24) the formula is exact to 1e-7."""
    p = GumbelSigmoidGate.inclusion(torch.tensor([0.0, 2.0, 2.22, 2.23]))
    torch.testing.assert_close(p[:2], torch.tensor([0.632184, 0.999482]), atol=1e-6, rtol=0)
    assert p[2] < 1 and p[3] == 1
    u = torch.arange(0, 2**24, 97, dtype=torch.float32) * 2**-24  # every 97th grid value: 173k of them
    noise = -(-(u + 1e-4).log() + 1e-4).log()
    for logit in (-5.0, -1.0, 0.0, 1.0, 2.0):
        on = (torch.sigmoid(logit + noise) > 0.5).double().mean()
        exact = GumbelSigmoidGate.inclusion(torch.tensor(logit, dtype=torch.float64))
        assert abs(on - exact) < 1e-5 + 1 / len(u)


@pytest.mark.parametrize("name", list(GATES))
def test_kl_clamp_zero_is_torchs_exact_bernoulli_kl(name):
    logits = torch.linspace(-5, 5, 41).repeat(3, 1).requires_grad_()
    rho = torch.tensor([0.05, 0.5, 0.999])[:, None].expand(3, 41)
    q = GATES[name](logits, kl_clamp=0.0)
    ours = torch.distributions.kl_divergence(q, dist.Bernoulli(rho))
    # gs-reference-kl takes the reference's KL, at sigmoid(logits): by name not KL(q || p)
    at = logits.sigmoid() if name == "gs-reference-kl" else q.probs
    exact = torch.distributions.kl_divergence(torch.distributions.Bernoulli(probs=at),
                                              torch.distributions.Bernoulli(probs=rho))
    torch.testing.assert_close(ours, exact)
    ours.sum().backward()  # gs is on with probability exactly 1 past logit 2.22: finite KL, no NaN gradient
    assert logits.grad.isfinite().all()


def test_reference_clamp_is_not_the_kl():
    alpha = torch.tensor([0.5, 0.995])
    clamped, exact = bernoulli_kl(alpha, 0.999, 0.01), bernoulli_kl(alpha, 0.999, 0.0)
    torch.testing.assert_close(clamped[0], torch.tensor(1.6145), atol=1e-4, rtol=0)
    torch.testing.assert_close(exact[0], torch.tensor(2.7612), atol=1e-4, rtol=0)
    a = torch.tensor(0.995, requires_grad=True)  # past the clamp: no gradient at all
    bernoulli_kl(a, 0.8, 0.01).backward()
    assert a.grad == 0
    # what each estimator's KL term computes, in the words plots and logs use
    assert gate_class("ste").kl_label(0.0) == "KL(q(g | x) || p(g))"
    assert gate_class("gs").kl_label(0.01) == "KL(q(g | x) || p(g)), rates clamped to [0.01, 0.99]"
    assert "not KL(q || p)" in gate_class("gs-reference-kl").kl_label(0.01)


# one JSON line: what kl_divergence does with Pyro's relaxed gates against Bernoulli, and the KL registry
KL_PROBE = """
import json, sys, importlib, pkgutil
import torch, pyro.distributions as dist
from torch.distributions.kl import _KL_REGISTRY
before = set(_KL_REGISTRY)
if sys.argv[1] == "package":
    import bayesncl_pyro
    for m in pkgutil.walk_packages(bayesncl_pyro.__path__, "bayesncl_pyro."):
        importlib.import_module(m.name)
out = {"added": sorted(f"{p.__module__}.{p.__qualname__}|{q.__module__}.{q.__qualname__}"
                       for p, q in set(_KL_REGISTRY) - before)}
logits = torch.tensor([-2.0, 0.0, 3.0])
for cls in (dist.RelaxedBernoulliStraightThrough, dist.RelaxedBernoulli):
    try:
        out[cls.__name__] = torch.distributions.kl_divergence(
            cls(torch.tensor(0.5), logits=logits), dist.Bernoulli(torch.full((3,), 0.8))).tolist()
    except NotImplementedError as e:
        out[cls.__name__] = "NotImplementedError"
print(json.dumps(out))
"""


def test_importing_the_package_leaves_pyros_kl_alone():
    """Stock Pyro (a fresh interpreter importing only pyro) and one that imported every module of the package
    agree on kl_divergence(RelaxedBernoulliStraightThrough, Bernoulli); the package adds KLs for its own
    classes only."""
    stock, ours = (json.loads(subprocess.run([sys.executable, "-c", KL_PROBE, which], capture_output=True,
                                             text=True, check=True).stdout) for which in ("pyro", "package"))
    assert stock.pop("added") == []
    added = ours.pop("added")
    assert added and all(entry.startswith("bayesncl_pyro.") for entry in added), added
    assert ours == stock


def test_config_does_not_import_pyro():
    code = "import sys, bayesncl_pyro.config; assert 'pyro' not in sys.modules, 'pyro imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_estimator_is_refused_with_the_names():
    with pytest.raises(UserError, match="unknown gate estimator 'concrete'.*relaxed, ste, gs, gs-reference-kl"):
        gate_class("concrete")


@pytest.mark.parametrize("name", list(GATES))
def test_guide_inclusion_probs_and_posterior_agree(name):
    guide = GateGuide(10, 16, 8, 100, estimator=name)
    h = torch.randn(6, 10) * 5
    q = guide.posterior(h)
    torch.testing.assert_close(guide.inclusion_probs(h), q.probs)
    assert isinstance(q, dist.Bernoulli) and q.has_rsample
    expanded = q.expand((4, 6, 8))  # what Pyro's plates do
    assert type(expanded) is type(q) and expanded.kl_clamp == q.kl_clamp
    assert expanded.rsample().shape == (4, 6, 8)
