"""q(g | x) is a real distribution and each estimator is an inference-side choice: the program as written draws
from q for every estimator, Pyro's score-function ELBO on it is unbiased, ``leg``'s training gradient is the
ELBO's while ``ste``'s and ``relaxed``'s are not, the KL says what it computes, and the package registers its KL
for its own classes only."""

import itertools
import json
import subprocess
import sys

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import Predictive, TraceGraph_ELBO
from pyro.infer.tracegraph_elbo import _compute_elbo

from bayesncl_pyro import BayesNCLHead
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate import dimensions as dm
from bayesncl_pyro.guides.gates import BernoulliGates, GateGuide, GumbelSigmoidGates
from bayesncl_pyro.infer.estimators import GATES, GateEstimator, gate_class
from bayesncl_pyro.infer.head import own_params
from bayesncl_pyro.nn.losses import bernoulli_kl, info_nce_rows, normalize

LOGITS = torch.linspace(-5, 5, 21)  # the range the guide's logit bound allows
DRAWS = 100_000
SAMPLED = [name for name in GATES if name != "ste"]


def _frequencies_match(draws: torch.Tensor, probs: torch.Tensor):
    """The draws' frequency of open gates against P(on): pooled over every gate (one statistic: the observed count
    of open gates minus its expectation) within 3 standard errors, and each gate's within 4.5 (a family-wise bound
    over a few dozen gates; 3 each would fail 1 seed in 15 by chance)."""
    n, p = draws.shape[0], probs.double().expand(draws.shape[1:])
    freq = draws.double().mean(0)
    var = p * (1 - p) / n
    assert abs((freq - p).sum()) <= 3 * var.sum().sqrt() + 1e-12
    assert ((freq - p).abs() <= 4.5 * var.sqrt() + 1e-12).all(), (freq - p) / var.sqrt()


def _head(gate, rows=4, dims=2, lam=0.3, clamp=0.0, seed=0, num_train=None, **kw):
    torch.manual_seed(seed)
    return BayesNCLHead(3, dims, 8, num_train=num_train or rows // 2, gate=gate, kl_weight=lam, kl_clamp=clamp,
                        prior_prob=0.6, temperature=0.5, **kw)


@pytest.mark.parametrize("name", list(GATES))
def test_predictive_on_the_program_as_written_draws_from_q(name):
    """pyro.infer.Predictive on the head's program (no estimator applied) returns draws of g whose frequency is
    q's P(on) for every estimator's family, ste's included: the program's gate site is a real distribution."""
    head = _head(name, rows=8, dims=3)
    z, h = torch.randn(8, 3), torch.randn(8, 3) * 3
    model, guide = head.program()
    with own_params(), pyro.validation_enabled(False):
        draws = Predictive(model, guide=guide, num_samples=300, return_sites=["g"])(z, h)["g"]
    probs = head.gate_probs(h).detach()
    assert draws.shape == (300, 8, 3) and set(draws.unique().tolist()) <= {0.0, 1.0}
    _frequencies_match(draws, probs)
    assert ((probs - 0.5).abs() > 0.2).sum() >= 3  # a test that tells draws from modes


@pytest.mark.parametrize("name", list(GATES))
def test_each_estimators_training_value(name):
    """What InfoNCE sees in training (the gate site's value under the estimator's reparam): exact 0/1 values, draws
    from q for the sampled estimators, the mode of q for ste; the site's distribution in the trace is q itself (the
    reparam sets the value only), made pathwise (no score term), and the KL is the estimator's ELBO's."""
    estimator = gate_class(name)(0.01)
    q = estimator.family(LOGITS.expand(DRAWS, -1), temperature=0.5)

    def guide():
        pyro.sample("g", q.to_event(1))

    site = poutine.trace(poutine.reparam(guide, config={"g": estimator})).get_trace().nodes["g"]
    value = site["value"]
    assert set(value.unique().tolist()) <= {0.0, 1.0}
    trained = site["fn"].base_dist
    assert type(trained) is estimator.family and site["fn"].has_rsample and not q.has_rsample  # q itself untouched
    assert trained.probs is q.probs and trained.head_logits is q.head_logits
    elbo = estimator.elbo()
    assert elbo.kl_clamp == 0.01
    torch.testing.assert_close(elbo.kl_probs(trained), LOGITS.sigmoid().expand_as(q.probs)
                               if name == "gs-reference-kl" else q.probs)
    again = poutine.trace(poutine.reparam(guide, config={"g": estimator})).get_trace().nodes["g"]["value"]
    if name == "ste":
        assert torch.equal(value, (q.probs > 0.5).float()) and torch.equal(again, value)
    else:
        _frequencies_match(value, q.probs[0])
        _frequencies_match(again, q.probs[0])
        assert not torch.equal(again, value)


def test_the_estimator_refuses_a_guide_of_another_family():
    def guide():
        pyro.sample("g", BernoulliGates(LOGITS).to_event(1))

    with pytest.raises(UserError, match="gs estimator trains a GumbelSigmoidGates gate site.*BernoulliGates"):
        poutine.trace(poutine.reparam(guide, config={"g": gate_class("gs")()})).get_trace()


def test_gs_probability_is_not_the_sigmoid_and_is_exact_on_the_float32_grid():
    """The reference's Gumbel: 0.632 at logit 0 where the sigmoid says 0.5, always on past logit 2.2204.
    Against every value torch.rand can return in float32 (k / 2^24) the formula is exact to 1e-7."""
    p = GumbelSigmoidGates.inclusion(torch.tensor([0.0, 2.0, 2.22, 2.23]))
    torch.testing.assert_close(p[:2], torch.tensor([0.632184, 0.999482]), atol=1e-6, rtol=0)
    assert p[2] < 1 and p[3] == 1
    u = torch.arange(0, 2**24, 97, dtype=torch.float32) * 2**-24  # every 97th grid value: 173k of them
    noise = -(-(u + 1e-4).log() + 1e-4).log()
    for logit in (-5.0, -1.0, 0.0, 1.0, 2.0):
        on = (torch.sigmoid(logit + noise) > 0.5).double().mean()
        exact = GumbelSigmoidGates.inclusion(torch.tensor(logit, dtype=torch.float64))
        assert abs(on - exact) < 1e-5 + 1 / len(u)


@pytest.mark.parametrize("family", [BernoulliGates, GumbelSigmoidGates])
def test_the_families_are_bernoullis_with_their_own_draw(family):
    """sample(), log_prob, enumeration and the KL are the Bernoulli's; rsample() is the family's hard,
    reparameterised draw; expand (what plates do) keeps the family."""
    logits = torch.linspace(-3, 3, 7, requires_grad=True)
    q = family(logits, temperature=0.5)
    assert not q.has_rsample and set(q.enumerate_support().flatten().tolist()) == {0.0, 1.0}
    value = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0])
    torch.testing.assert_close(q.log_prob(value), dist.Bernoulli(q.probs).log_prob(value))
    rho = torch.full((7,), 0.8)
    torch.testing.assert_close(torch.distributions.kl_divergence(q, dist.Bernoulli(rho)),
                               torch.distributions.kl_divergence(torch.distributions.Bernoulli(q.probs),
                                                                 torch.distributions.Bernoulli(rho)))
    draw = q.rsample()
    assert set(draw.unique().tolist()) <= {0.0, 1.0} and draw.requires_grad
    expanded = q.expand((4, 7))
    assert type(expanded) is family and expanded.temperature == q.temperature
    assert expanded.rsample().shape == expanded.sample().shape == (4, 7)


@pytest.mark.parametrize("name", list(GATES))
def test_kl_clamp_zero_is_torchs_exact_bernoulli_kl(name):
    logits = torch.linspace(-5, 5, 41).repeat(3, 1).requires_grad_()
    rho = torch.tensor([0.05, 0.5, 0.999])[:, None].expand(3, 41)
    estimator = gate_class(name)(kl_clamp=0.0)
    q = estimator.family(logits)
    ours, kind = estimator.elbo()._kl(q, dist.Bernoulli(rho), None)  # the site's KL as its ELBO takes it
    assert kind == "analytic"
    # gs-reference-kl takes the reference's KL, at sigmoid(logits): by name not KL(q || p)
    at = logits.sigmoid() if name == "gs-reference-kl" else q.probs
    exact = torch.distributions.kl_divergence(torch.distributions.Bernoulli(probs=at),
                                              torch.distributions.Bernoulli(probs=rho))
    torch.testing.assert_close(ours, exact)
    ours.sum().backward()  # gs is on with probability exactly 1 past logit 2.22: finite KL, no NaN gradient
    assert logits.grad.isfinite().all()


@pytest.mark.parametrize("clamp", [0.0, 0.01])
def test_kl_label_says_what_the_kl_term_computes(clamp):
    """The one KL label, ``GateEstimator.kl_label``: each estimator's names the probabilities its ELBO's KL term is
    taken at and the clamp; the report's and figures' KL per dimension is the base estimator's term."""
    logits = torch.linspace(-5, 5, 41).repeat(3, 1)
    rho = torch.tensor([0.05, 0.5, 0.999])[:, None].expand(3, 41)
    exact = "KL(q(g | x) || p(g)) at q's inclusion probabilities"
    suffix = ", rates clamped to [0.01, 0.99]" if clamp else ""
    assert GateEstimator.kl_label(clamp) == exact + suffix
    for name in GATES:
        estimator = gate_class(name)(kl_clamp=clamp)
        q = estimator.family(logits)
        term, _ = estimator.elbo()._kl(q, dist.Bernoulli(rho), None)
        at_q, at_sigmoid = bernoulli_kl(q.probs, rho, clamp), bernoulli_kl(logits.sigmoid(), rho, clamp)
        label = type(estimator).kl_label(clamp)
        assert label.endswith(suffix) and ("clamped" in label) == bool(clamp), (name, label)
        if name == "gs-reference-kl":  # the reference's KL, at sigmoid(l): not q's probability for this family
            assert label == "the reference's KL at sigmoid(l) (not KL(q || p))" + suffix
            torch.testing.assert_close(term, at_sigmoid)
            assert not torch.allclose(term, at_q)
        else:
            assert label == exact + suffix, name
            torch.testing.assert_close(term, at_q)
    # the report's KL per dimension: the base estimator's term (at q's probabilities), for the gs family too
    q, rate = GumbelSigmoidGates(logits), torch.linspace(0.05, 0.95, 41)
    term, _ = GateEstimator(kl_clamp=clamp).elbo()._kl(q, dist.Bernoulli(rate.expand_as(logits)), None)
    torch.testing.assert_close(dm.kl_per_dim(q.probs, rate, clamp), term.mean(0))


def test_reference_clamp_is_not_the_kl():
    alpha = torch.tensor([0.5, 0.995])
    clamped, exact = bernoulli_kl(alpha, 0.999, 0.01), bernoulli_kl(alpha, 0.999, 0.0)
    torch.testing.assert_close(clamped[0], torch.tensor(1.6145), atol=1e-4, rtol=0)
    torch.testing.assert_close(exact[0], torch.tensor(2.7612), atol=1e-4, rtol=0)
    a = torch.tensor(0.995, requires_grad=True)  # past the clamp: no gradient at all
    bernoulli_kl(a, 0.8, 0.01).backward()
    assert a.grad == 0
    # what each estimator's loss computes, in the words plots and logs use
    assert "not -ELBO" in gate_class("ste").objective and gate_class("leg").objective.startswith("-ELBO")
    assert [name for name in GATES if gate_class(name).unbiased] == ["leg"]


# --- gradients against exact enumeration: 4 rows x 2 dims, all 2^8 gate configurations -------------------------

CONFIGS = torch.tensor(list(itertools.product([0.0, 1.0], repeat=8))).view(-1, 4, 2)


def _exact_objective(head, h):
    """-ELBO / 2N as a function of the head's parameters, exactly: E_q[mean_i l_i] over every gate configuration,
    plus lambda times the training KL per row (the estimator's clamp)."""
    z = head.projector(h)
    u = head.model.features(z)
    q = head.guide.posterior(h)
    weights = q.log_prob(CONFIGS).sum((1, 2)).exp()
    nce = torch.stack([info_nce_rows(normalize(u * c), head.model.temperature).mean() for c in CONFIGS])
    kl = bernoulli_kl(q.probs, head.model.prior.rate(), head.estimator.kl_clamp).sum(1).mean()
    return (weights * nce).sum() + head.model.kl_weight * kl


def _grad(loss, params):
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def _head_and_batch(gate):
    head = _head(gate, seed=3, num_train=10)  # the batch is a fifth of the data: the ELBO scales it up
    with torch.no_grad():  # gates spread over (0.1, 0.9), so that no estimator is right by luck; every feature on
        head.guide.head[-1].weight.mul_(3.0)
        head.projector[-1].bias.add_(1.0)
    return head, torch.randn(4, 3, generator=torch.Generator().manual_seed(4))


def test_legs_training_gradient_is_the_elbos_and_ste_relaxed_are_not():
    """The mean gradient of the training path (``head(h)[0].backward()``) over many draws against the exact
    gradient of -ELBO / 2N: within 4 standard errors in every coordinate for leg, for the gating head and the
    projector; ste (deterministic: its mean is its one gradient) and relaxed fail the same assertion on the
    gating head. On the projector (pathwise at a draw) relaxed and st-sampled are unbiased too, ste is not."""
    draws, within = 400, {}
    for gate in ("leg", "ste", "relaxed", "st-sampled"):
        head, h = _head_and_batch(gate)
        groups = {"gating head": list(head.guide.head.parameters()), "projector": list(head.projector.parameters())}
        params = [p for group in groups.values() for p in group]
        sizes = [sum(p.numel() for p in group) for group in groups.values()]
        exact = _grad(_exact_objective(head, h), params).split(sizes)
        with pyro.validation_enabled(False):  # as the trainer runs
            grads = torch.stack([_grad(head(h)[0], params) for _ in range(1 if gate == "ste" else draws)]).double()
        mean = grads.mean(0)
        se = grads.std(0) / len(grads) ** 0.5 if len(grads) > 1 else torch.zeros_like(mean)
        for name, m, s, e in zip(groups, mean.split(sizes), se.split(sizes), exact):
            assert e.norm() > 1e-3
            within[gate, name] = bool(((m - e).abs() <= 4 * s + 1e-7).all())
    assert within == {("leg", "gating head"): True, ("leg", "projector"): True,
                      ("ste", "gating head"): False, ("ste", "projector"): False,
                      ("relaxed", "gating head"): False, ("relaxed", "projector"): True,
                      ("st-sampled", "gating head"): within["st-sampled", "gating head"],  # biased, but not asserted
                      ("st-sampled", "projector"): True}, within


def test_tracegraph_on_the_program_as_written_is_unbiased():
    """Pyro's own TraceGraph_ELBO on the head's program as written (the discrete site: the score function), its
    single-draw gradient of the gating head averaged exactly over all 2^8 configurations, equals the exact
    gradient of the ELBO (exact KL: TraceGraph samples log q - log p of the Bernoullis)."""
    head, h = _head_and_batch("ste")
    params = list(head.guide.head.parameters())
    exact = _grad(_exact_objective(head, h), params)
    z = head.projector(h).detach()
    model, guide = head.program()
    elbo, total = TraceGraph_ELBO(max_plate_nesting=1), 0.0
    with own_params(), pyro.validation_enabled(False):
        template = poutine.trace(guide).get_trace(z, h)
        q = head.guide.posterior(h)
        for c in CONFIGS:
            template.nodes["g"]["value"] = c
            model_trace, guide_trace = elbo._get_trace(model, poutine.replay(guide, trace=template), (z, h), {})
            surrogate = _compute_elbo(model_trace, guide_trace)[1] / head.num_rows  # a loss
            total = total + q.log_prob(c).sum().exp().detach() * surrogate
    torch.testing.assert_close(_grad(total, params), exact, rtol=1e-4, atol=1e-6)


# --- the package ------------------------------------------------------------------------------------------------

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
    agree on kl_divergence(RelaxedBernoulliStraightThrough, Bernoulli); the package registers no KL at all (the
    training KL's clamp is an argument of its ELBO)."""
    stock, ours = (json.loads(subprocess.run([sys.executable, "-c", KL_PROBE, which], capture_output=True,
                                             text=True, check=True).stdout) for which in ("pyro", "package"))
    assert stock.pop("added") == [] and ours.pop("added") == []
    assert ours == stock


def test_config_does_not_import_pyro():
    code = "import sys, bayesncl_pyro.config; assert 'pyro' not in sys.modules, 'pyro imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unknown_estimator_is_refused_with_the_names():
    with pytest.raises(UserError, match="unknown gate estimator 'concrete'.*ste, relaxed, st-sampled, leg, gs, "
                                        "gs-reference-kl"):
        gate_class("concrete")


@pytest.mark.parametrize("name", list(GATES))
def test_the_guide_draws_from_its_estimators_family(name):
    family = gate_class(name).family
    guide = GateGuide(10, 16, 8, 100, family=family)
    h = torch.randn(6, 10) * 5
    q = guide.posterior(h)
    assert type(q) is family
    torch.testing.assert_close(q.probs, family.inclusion(guide.logits(h)))
    assert set(poutine.trace(guide).get_trace(None, h).nodes["g"]["value"].unique().tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("name, logit, ratio", [("relaxed", 0.0, 2 / 3), ("relaxed", 2.0, 1.080), ("gs", 0.0, 0.524),
                                                ("gs", 1.0, 0.841), ("gs", 2.0, 19.4), ("st-sampled", 0.0, 1.0),
                                                ("st-sampled", 2.0, 1.0), ("ste", 1.0, 1.0)])
def test_the_straight_through_weight_against_the_true_slope(name, logit, ratio):
    """For a loss linear in one gate, E[d value / d l] against the true dP(on)/dl (docs/RESULTS.md's mechanisms):
    the binary Concrete's relaxed gradient is E[sigma'(l + L)] / sigma'(l) = 2/3 of it at l = 0 (logistic L), gs's
    straight-through weight 0.52 at l = 0, 0.84 at l = 1 and 19.4 at l = 2, where its P is nearly 1; st-sampled's
    and ste's are exact (their bias is InfoNCE's curvature alone)."""
    torch.manual_seed(0)
    estimator = gate_class(name)()
    logits = torch.full((400_000,), logit, requires_grad=True)
    estimator.value(estimator.family(logits)).sum().backward()
    at = torch.tensor(logit, requires_grad=True)
    estimator.family.inclusion(at).backward()
    assert logits.grad.mean().item() / at.grad.item() == pytest.approx(ratio, rel=0.02)
