import itertools

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro import poutine
from pyro.infer import TraceGraph_ELBO, TraceMeanField_ELBO
from pyro.infer.tracegraph_elbo import _compute_elbo

from bayesncl_pyro.config import Config
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.guides.gates import BernoulliGates, GateGuide
from bayesncl_pyro.infer.elbo import MeanFieldELBO
from bayesncl_pyro.infer.estimators import GATES, gate_class
from bayesncl_pyro.infer.head import BayesNCLHead
from bayesncl_pyro.infer.learner import ContrastiveLearner
from bayesncl_pyro.models.bayesncl import ContrastiveModel, rows_plate
from bayesncl_pyro.models.priors import PRIORS, BetaBernoulliPrior, build_prior
from bayesncl_pyro.nn.losses import bernoulli_kl, info_nce_rows, normalize
from bayesncl_pyro.train.resolve import resolve

R, K, D, N = 12, 8, 10, 1000


def _inputs():
    torch.manual_seed(0)
    return torch.randn(R, K, requires_grad=True), torch.randn(R, D)


def _program(estimator="ste", prior="bernoulli", kl_weight=3e-5, rho=0.8):
    """(model, guide, the guide with the estimator applied: what training differentiates)."""
    p = build_prior(prior, K, rho)
    model = ContrastiveModel(N, 0.2, "relu", prior=p, kl_weight=kl_weight)
    est = gate_class(estimator)()
    guide = GateGuide(D, 16, K, N, family=est.family, kl_weight=kl_weight,
                      rate_guide=p.make_guide(D) if p.row_latents else p.make_guide(), row_latents=p.row_latents)
    return model, guide, poutine.reparam(guide, config={"g": est})


def test_parity_with_reference_formula_ste():
    """-ELBO / num_rows with the STE gate == InfoNCE + lambda * mean_rows sum_dims KL (docs/METHOD.md, the ELBO)."""
    z, h = _inputs()
    model, guide, trained = _program("ste")
    loss = TraceMeanField_ELBO().differentiable_loss(model, trained, z, h) / N
    alpha = guide.logits(h).sigmoid()
    u = F.normalize(F.normalize(F.relu(z), dim=1) * (alpha > 0.5).float(), dim=1)
    reference = info_nce_rows(u, 0.2).mean() + 3e-5 * bernoulli_kl(alpha, 0.8, 0.01).sum(1).mean()
    assert abs(loss.item() - reference.item()) < 1e-5


def _reference_step_loss(learner, x, kl_weight, rho):
    """docs/METHOD.md, "The reference computation, step by step", in plain PyTorch (rep_relu, STE gate,
    NT-Xent, clamped KL)."""
    h = learner.backbone(x)
    z = learner.head.projector(h)
    gelu = F.gelu(z)
    z = F.normalize(gelu - gelu.detach() + F.relu(z).detach(), dim=1)
    alpha = learner.guide.logits(h).sigmoid()
    m = (alpha > 0.5).to(alpha) + alpha - alpha.detach()
    u = F.normalize(z * m, dim=1)
    rows = u.shape[0]
    sim = (u @ u.T / 0.2).masked_fill(torch.eye(rows, dtype=torch.bool), float("-inf"))
    partner = (torch.arange(rows) + rows // 2) % rows
    nce = (torch.logsumexp(sim, 1) - sim[torch.arange(rows), partner]).mean()
    a = alpha.clamp(0.01, 0.99)
    kl = (a * (a / rho).log() + (1 - a) * ((1 - a) / (1 - rho)).log()).sum(1).mean()
    return nce + kl_weight * kl


# rates exact in float32, where the prior keeps its buffer
@pytest.mark.parametrize("kl_weight, rho", [(3e-5, 0.75), (0.05, 0.25)])
def test_every_gradient_matches_the_plain_pytorch_reference(kl_weight, rho):
    """Through Pyro and the fast ELBO, every parameter's gradient equals the plain formula's (float64):
    backbone, projector, gating head (the straight-through path and the KL), at any prior strength."""
    cfg = resolve(Config(dataset="cifar10", encoder="cnn", gate="ste", proj_hidden=32, proj_dim=16,
                         batch_size=8, kl_weight=kl_weight, prior_prob=rho))
    learner = ContrastiveLearner(cfg, in_channels=3, num_train=500).double()
    x = torch.randn(16, 3, 32, 32, dtype=torch.float64)
    with pyro.validation_enabled(False):  # the trainer's fast path
        ours, _ = learner(x)
    ours.backward()
    grads = {n: p.grad.clone() for n, p in learner.named_parameters()}
    learner.zero_grad()
    reference = _reference_step_loss(learner, x, kl_weight, rho)
    reference.backward()
    torch.testing.assert_close(ours, reference, rtol=1e-10, atol=0)
    assert grads["head.guide.head.0.weight"].abs().max() > 0
    for name, p in learner.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_kl_weight_scales_only_the_kl():
    _, h = _inputs()
    runs = {}
    for lam in (1e-3, 2e-3):
        torch.manual_seed(5)
        loss, stats = BayesNCLHead(D, K, 16, num_train=N // 2, kl_weight=lam)(h)
        runs[lam] = loss.item(), stats.nce.item(), stats.kl.item()
    # same init (same seed) -> same gates -> same InfoNCE; the KL part doubles, the KL itself stays
    (loss1, nce1, kl1), (loss2, nce2, kl2) = runs[1e-3], runs[2e-3]
    assert nce1 == nce2 and kl1 > 0
    assert loss2 - nce2 == pytest.approx(2 * (loss1 - nce1), rel=1e-4)
    assert kl2 == pytest.approx(kl1, rel=1e-3)


@pytest.mark.parametrize("name", ["ste", "st-sampled"])
def test_straight_through_estimators_forward_hard_and_backward_to_alpha(name):
    logits = torch.randn(4, K, requires_grad=True)
    est = gate_class(name)()
    g = est.value(est.family(logits))
    if name == "ste":
        torch.testing.assert_close(g, (logits.sigmoid() > 0.5).float())
    assert set(g.unique().tolist()) <= {0.0, 1.0}
    g.sum().backward()
    torch.testing.assert_close(logits.grad, (logits.sigmoid() * (1 - logits.sigmoid())).detach())
    for other in ("relaxed", "gs", "leg"):
        est = gate_class(other)()
        v = est.value(est.family(torch.randn(4, K)))
        assert set(v.unique().tolist()) <= {0.0, 1.0}


def test_relaxed_gate_on_rate_matches_sigmoid_of_logits():
    logits = torch.tensor([-1.0, 0.0, 2.0]).expand(20000, 3)
    g = BernoulliGates(logits, torch.tensor(0.5)).rsample()
    torch.testing.assert_close(g.mean(0), torch.tensor([-1.0, 0.0, 2.0]).sigmoid(), atol=0.015, rtol=0)


def test_logits_are_bounded_with_gradient():
    _, guide, _ = _program()
    h = torch.randn(R, D)
    raw = guide.head(h)
    # raw logits up to twice the bound (the head is ReLU-homogeneous up to bias)
    h = h * (2 * guide.logit_bound / raw.abs().max())
    logits = guide.logits(h)
    assert logits.abs().max() <= guide.logit_bound
    logits.abs().max().backward()
    # a squashed, not clipped, logit: the largest one still passes gradient to the head
    assert guide.head[-1].weight.grad.abs().sum() > 0


def test_head_does_not_train_the_backbone():
    z, h = _inputs()
    h = h.requires_grad_()
    model, _, guide = _program("relaxed")
    TraceMeanField_ELBO().differentiable_loss(model, guide, z, h).backward()
    assert h.grad is None and z.grad is not None


@pytest.mark.parametrize("prior", sorted(PRIORS))
@pytest.mark.parametrize("gate", sorted(GATES))
def test_every_prior_and_gate_trains_one_step(prior, gate):
    z, h = _inputs()
    model, guide, trained = _program(gate, prior)
    params = list(guide.parameters()) + list(model.parameters())
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params + [z], lr=0.1)
    loss = TraceMeanField_ELBO().differentiable_loss(model, trained, z, h) / N
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, params))


def test_beta_bernoulli_has_a_global_rate_latent_in_model_and_guide():
    z, h = _inputs()
    model, guide, _ = _program("relaxed", "beta-bernoulli")
    tr = pyro.poutine.trace(guide).get_trace(z, h)
    assert tr.nodes["rate"]["fn"].event_shape == (K,)
    assert {"rate", "g"} <= set(tr.stochastic_nodes)
    assert tr.nodes["rate"]["scale"] == pytest.approx(3e-5)  # global: lambda, no plate scaling
    prior = BetaBernoulliPrior(K, 0.7, concentration=4.0)
    torch.testing.assert_close(prior.mean_rate(), torch.full((K,), 0.7))


@pytest.mark.parametrize("name", ["bernoulli", "learned"])
def test_a_prior_of_bernoulli_gates_is_its_rates_for_every_row(name):
    """prior(rows) of a rate-only prior: Bernoulli gates at rate() on each row (what the model sampled before priors
    were distributions), and its mean rate the rates themselves, bit for bit (the report's prior rate)."""
    prior = build_prior(name, K, 0.7)
    gates = prior(5)
    assert (gates.batch_shape, gates.event_shape) == ((5,), (K,)) and isinstance(gates.base_dist, dist.Bernoulli)
    assert torch.equal(gates.base_dist.probs, prior.rate().expand(5, -1))
    assert torch.equal(prior.mean_rate(), prior.rate().detach())


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.2, 1.5])
def test_bad_prior_rate_is_rejected(bad):
    with pytest.raises(UserError, match="between 0 and 1"):
        build_prior("bernoulli", K, bad)


def test_bad_beta_concentration_and_unknown_prior():
    with pytest.raises(UserError, match="concentration must be positive"):
        BetaBernoulliPrior(K, 0.8, concentration=0.0)
    with pytest.raises(UserError, match="beta-bernoulli"):
        build_prior("spike-slab", K, 0.8)


@pytest.mark.parametrize("method", ["cl", "ncl", "bayesncl"])
def test_all_methods_train_through_one_svi_path(method):
    cfg = resolve(Config(dataset="digits", method=method, proj_hidden=32, proj_dim=16))
    learner = ContrastiveLearner(cfg, in_channels=1, num_train=100)
    x = torch.randn(8, 1, 8, 8)
    loss, _ = learner(x)
    loss.backward()
    assert torch.isfinite(loss)
    assert learner.gated == (method == "bayesncl")
    h, feats = learner.representation(x)
    assert feats.shape == (8, 16)
    if method == "cl":
        assert (feats < 0).any()
    else:
        assert (feats >= 0).all()


def test_beta_bernoulli_rates_follow_the_data_to_the_conjugate_posterior():
    """The global rate's KL is weighted lambda / 2N per row, yet the data move the rates: they reach q(rate)
    through the gates' KL, summed over all 2N rows, so q(rate_k) goes to the conjugate posterior
    Beta(a + sum_i alpha_ik, b + sum_i (1 - alpha_ik)). Gates that are on with probability 0.3 in 40 rows,
    a Beta(8, 2) hyperprior (mean 0.8): Beta(20, 30), mean 0.4, trained as the learner trains the rates
    (SGD with momentum at gate_lr / lambda)."""
    rows, lam = 40, 3e-5
    prior = BetaBernoulliPrior(K, 0.8, concentration=10.0)
    model = ContrastiveModel(rows, 0.2, "relu", prior=prior, kl_weight=lam)
    guide = GateGuide(D, 16, K, rows, kl_weight=lam, rate_guide=prior.make_guide())
    with torch.no_grad():
        guide.head[-1].weight.zero_()
        guide.head[-1].bias.fill_(torch.tensor(0.3).logit().item())
    rates = guide.rate_guide
    opt = torch.optim.SGD(rates.parameters(), lr=0.1 / lam, momentum=0.9)
    z, h = torch.randn(rows, K), torch.randn(rows, D)
    a, b = [], []
    with pyro.validation_enabled(False):
        for step in range(600):
            opt.zero_grad()
            trained = poutine.reparam(guide, config={"g": gate_class("ste")()})
            (MeanFieldELBO().differentiable_loss(model, trained, z, h) / rows).backward()
            opt.step()
            if step >= 300:  # the iterates scatter around the optimum (one Beta draw per step)
                a.append(rates.a.detach().clone())
                b.append(rates.b.detach().clone())
    a, b = torch.stack(a).mean(0), torch.stack(b).mean(0)
    torch.testing.assert_close(a / (a + b), torch.full((K,), 0.4), atol=0.03, rtol=0)
    torch.testing.assert_close(a + b, torch.full((K,), 50.0), rtol=0.2, atol=0)


def _in_plate_model(model):
    """The program as it would read with the InfoNCE factor inside the rows plate (a false independence)."""

    def program(z, h):
        u = model.features(z)
        rows = u.shape[0]
        with poutine.scale(scale=model.kl_weight):
            rate = model.prior.rate()
        with rows_plate(model.num_rows, rows, u.device):
            with poutine.scale(scale=model.kl_weight):
                g = pyro.sample("g", dist.Bernoulli(rate.expand(rows, -1)).to_event(1))
            pyro.factor("nce", -info_nce_rows(normalize(u * g), model.temperature))

    return program


def test_score_function_estimator_sees_that_infonce_couples_the_rows():
    """TraceGraph_ELBO with a score-function (plain Bernoulli) gate guide, its single-particle gradient averaged
    exactly over all 2^8 gate configurations of 4 rows x 2 dims, equals the exact ELBO gradient: the program
    tells Pyro that every row's gates reach every row's InfoNCE. With the factor inside the rows plate the same
    estimator weights row i's score by row i's loss only, and is biased."""
    rows, dims, lam = 4, 2, 0.3
    torch.manual_seed(1)
    z, h = torch.rand(rows, dims) + 0.1, torch.randn(rows, D)
    theta = torch.randn(rows, dims, requires_grad=True)
    model = ContrastiveModel(rows, 0.5, "relu", prior=build_prior("bernoulli", dims, 0.6), kl_weight=lam)

    def guide(z, h):
        with poutine.scale(scale=lam), rows_plate(rows, rows, z.device):
            pyro.sample("g", dist.Bernoulli(logits=theta).to_event(1))

    configs = torch.tensor(list(itertools.product([0.0, 1.0], repeat=rows * dims))).view(-1, rows, dims)
    q = dist.Bernoulli(logits=theta).to_event(2)
    p = dist.Bernoulli(torch.full((rows, dims), 0.6)).to_event(2)
    u = model.features(z)
    exact = sum(q.log_prob(c).exp()
                * (-info_nce_rows(normalize(u * c), 0.5).sum() + lam * (p.log_prob(c) - q.log_prob(c)))
                for c in configs)
    exact_grad, = torch.autograd.grad(exact, theta)

    def expected_tracegraph_gradient(program):
        elbo, total = TraceGraph_ELBO(max_plate_nesting=1), 0.0
        template = poutine.trace(guide).get_trace(z, h)
        for c in configs:
            template.nodes["g"]["value"] = c
            model_trace, guide_trace = elbo._get_trace(program, poutine.replay(guide, trace=template), (z, h), {})
            surrogate_loss = _compute_elbo(model_trace, guide_trace)[1]
            total = total - q.log_prob(c).exp().detach() * surrogate_loss
        return torch.autograd.grad(total, theta)[0]

    torch.testing.assert_close(expected_tracegraph_gradient(model), exact_grad, rtol=1e-4, atol=1e-5)
    biased = expected_tracegraph_gradient(_in_plate_model(model))
    assert (biased - exact_grad).norm() > 0.1 * exact_grad.norm()


def test_the_rows_plate_reuses_its_indices_on_the_device_and_never_as_an_inference_tensor():
    """The plate's subsample, ``arange(rows)``, is built once per batch size and device, and one first built under
    ``torch.inference_mode`` (an evaluation) still serves a training step: the site's scale is unchanged."""
    with torch.inference_mode():
        with poutine.trace() as first, rows_plate(N, 37, torch.device("cpu")):
            pass
    indices = first.trace.nodes["rows"]["value"]
    assert not indices.is_inference() and torch.equal(indices, torch.arange(37))
    with poutine.trace() as second, rows_plate(N, 37, torch.device("cpu")):
        pyro.sample("x", dist.Normal(torch.zeros(37), 1.0))
    assert second.trace.nodes["rows"]["value"] is indices
    assert second.trace.nodes["x"]["scale"] == N / 37
    with poutine.trace() as other, rows_plate(N, 36, torch.device("cpu")):
        pass
    assert torch.equal(other.trace.nodes["rows"]["value"], torch.arange(36))
