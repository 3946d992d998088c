import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import TraceMeanField_ELBO

from bayesncl_pyro.config import Config, resolve
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.head import BayesNCLHead
from bayesncl_pyro.learner import ContrastiveLearner
from bayesncl_pyro.losses import bernoulli_kl, info_nce_rows
from bayesncl_pyro.guides.gates import GATES, GateGuide, GumbelSigmoidGate, ThresholdGate
from bayesncl_pyro.models.bayesncl import ContrastiveModel
from bayesncl_pyro.models.priors import PRIORS, BetaBernoulliPrior, build_prior

R, K, D, N = 12, 8, 10, 1000


def _inputs():
    torch.manual_seed(0)
    return torch.randn(R, K, requires_grad=True), torch.randn(R, D)


def _program(estimator="ste", prior="bernoulli", kl_weight=3e-5, rho=0.8):
    p = build_prior(prior, K, rho)
    model = ContrastiveModel(N, 0.2, "relu", prior=p, kl_weight=kl_weight)
    guide = GateGuide(D, 16, K, N, estimator=estimator, kl_weight=kl_weight, rate_guide=p.make_guide())
    return model, guide


@pytest.mark.parametrize("gate", sorted(GATES))
def test_kl_is_registered_and_is_the_discrete_bernoulli_kl(gate):
    logits = torch.randn(5, K)
    q = GATES[gate](torch.tensor(1.0), logits=logits)
    kl = torch.distributions.kl_divergence(q, dist.Bernoulli(torch.full((5, K), 0.8)))
    torch.testing.assert_close(kl, bernoulli_kl(logits.sigmoid(), 0.8))


def test_parity_with_reference_formula_ste():
    """-ELBO / num_rows with the STE gate == InfoNCE + lambda * mean_rows sum_dims KL (docs/METHOD.md, the ELBO)."""
    z, h = _inputs()
    model, guide = _program("ste")
    loss = TraceMeanField_ELBO().differentiable_loss(model, guide, z, h) / N
    alpha = guide.logits(h).sigmoid()
    u = F.normalize(F.normalize(F.relu(z), dim=1) * (alpha > 0.5).float(), dim=1)
    reference = info_nce_rows(u, 0.2).mean() + 3e-5 * bernoulli_kl(alpha, 0.8).sum(1).mean()
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
        runs[lam] = loss.item(), stats["nce"].item(), stats["kl"].item()
    # same init (same seed) -> same gates -> same InfoNCE; the KL part doubles, the KL itself stays
    (loss1, nce1, kl1), (loss2, nce2, kl2) = runs[1e-3], runs[2e-3]
    assert nce1 == nce2 and kl1 > 0
    assert loss2 - nce2 == pytest.approx(2 * (loss1 - nce1), rel=1e-4)
    assert kl2 == pytest.approx(kl1, rel=1e-3)


def test_gate_estimators_forward_hard_and_backward_to_alpha():
    logits = torch.randn(4, K, requires_grad=True)
    g = ThresholdGate(torch.tensor(1.0), logits=logits).rsample()
    torch.testing.assert_close(g, (logits.sigmoid() > 0.5).float())
    g.sum().backward()
    torch.testing.assert_close(logits.grad, (logits.sigmoid() * (1 - logits.sigmoid())).detach())
    for cls in (GumbelSigmoidGate, dist.RelaxedBernoulliStraightThrough):
        v = cls(torch.tensor(1.0), logits=torch.randn(4, K)).rsample()
        assert set(v.unique().tolist()) <= {0.0, 1.0}


def test_relaxed_gate_on_rate_matches_sigmoid_of_logits():
    logits = torch.tensor([-1.0, 0.0, 2.0]).expand(20000, 3)
    g = dist.RelaxedBernoulliStraightThrough(torch.tensor(0.5), logits=logits).rsample()
    torch.testing.assert_close(g.mean(0), torch.tensor([-1.0, 0.0, 2.0]).sigmoid(), atol=0.015, rtol=0)


def test_logits_are_bounded_with_gradient():
    _, guide = _program()
    h = torch.randn(R, D)
    raw = guide.head(h)
    h = h * (2 * guide.logit_bound / raw.abs().max())  # raw logits up to twice the bound (head is ReLU-homogeneous up to bias)
    logits = guide.logits(h)
    assert logits.abs().max() <= guide.logit_bound
    logits.abs().max().backward()
    # a squashed, not clipped, logit: the largest one still passes gradient to the head
    assert guide.head[-1].weight.grad.abs().sum() > 0


def test_head_does_not_train_the_backbone():
    z, h = _inputs()
    h = h.requires_grad_()
    model, guide = _program("relaxed")
    TraceMeanField_ELBO().differentiable_loss(model, guide, z, h).backward()
    assert h.grad is None and z.grad is not None


@pytest.mark.parametrize("prior", sorted(PRIORS))
@pytest.mark.parametrize("gate", sorted(GATES))
def test_every_prior_and_gate_trains_one_step(prior, gate):
    z, h = _inputs()
    model, guide = _program(gate, prior)
    params = list(guide.parameters()) + list(model.parameters())
    before = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params + [z], lr=0.1)
    loss = TraceMeanField_ELBO().differentiable_loss(model, guide, z, h) / N
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, params))


def test_beta_bernoulli_has_a_global_rate_latent_in_model_and_guide():
    z, h = _inputs()
    model, guide = _program("relaxed", "beta-bernoulli")
    tr = pyro.poutine.trace(guide).get_trace(z, h)
    assert tr.nodes["rate"]["fn"].event_shape == (K,)
    assert {"rate", "g"} <= set(tr.stochastic_nodes)
    assert tr.nodes["rate"]["scale"] == pytest.approx(3e-5)  # global: lambda, no plate scaling
    prior = BetaBernoulliPrior(K, 0.7, concentration=4.0)
    torch.testing.assert_close(prior.mean_rate(), torch.full((K,), 0.7))


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
