"""The novelty controls: gating heads fitted on a run's frozen backbone, to tell the *Bayesian* part's share.

Three controls for a gated run (``novelty_scores.SCORES``' ``control_*``): the same gating head trained with the KL
weight at 0 (a gating head with no prior), one trained at the run's lambda, and an ensemble of ``ENSEMBLE`` such heads
(the mutual information of the gates with the member, the spread of q across members). Each is trained on one pass of
two augmented views of the training split through the frozen backbone and projector (:func:`fit_control_heads`);
``novelty_scores.NoveltyScorer`` scores images with them.
"""

from dataclasses import dataclass

import torch

from bayesncl_pyro.nn.encoders import mlp
from bayesncl_pyro.nn.losses import bernoulli_kl, bound_logits, info_nce_rows, normalize

ENSEMBLE = 5
"""Gating heads in the ensemble control."""


@dataclass
class ControlHeads:
    """Gating heads trained on a run's frozen backbone (:func:`fit_control_heads`): the KL-0 head and the ensemble."""

    kl0: torch.nn.Module
    ensemble: list[torch.nn.Module]
    logit_bound: float

    @torch.no_grad()
    def probs(self, head: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        """q(g = 1 | x) of one control head at backbone features h (N x K)."""
        return torch.sigmoid(bound_logits(head(h.float()), self.logit_bound))


@torch.no_grad()
def marginal_rate(learner) -> torch.Tensor:
    """K: the prior's inclusion rates, what the control heads' KL is taken against.

    A prior's global latents at their posterior; a prior with a rate per image (``row_latents``) at its mean,
    ``prior_prob``.
    """
    prior = learner.model.prior
    if prior.row_latents:
        return torch.full((learner.cfg.proj_dim,), float(prior.prior_prob))
    return prior.mean_rate(learner.guide.rate_guide).detach().float().cpu()


def fit_control_heads(learner, view1: torch.Tensor, view2: torch.Tensor, steps: int, batch_size: int,
                      seed: int = 0) -> ControlHeads:
    """The control gating heads of a gated learner, trained on its frozen backbone's features of two views.

    ``view1``, ``view2``: N x D backbone features of two augmented views of the training images (rows paired). Each
    head has the run's gating head's shape and logit bound and is trained as the reference trains it, InfoNCE of
    normalise(features(z) * g) at the mode g = 1[q > 0.5] straight-through plus lambda times the clamped KL to the
    prior's rates (the run's ``kl_clamp``), for ``steps`` steps of ``batch_size`` images, SGD at the run's gate lr
    with momentum 0.9; the projector and backbone stay as trained. The KL-0 head has lambda 0; the ensemble's members
    the run's last lambda and seeds ``seed * 100 + 1 ...``.
    """
    head, cfg = learner.head, learner.cfg
    device = next(learner.parameters()).device
    rate = marginal_rate(learner).to(device)
    with torch.no_grad():
        u1, u2 = (head.ungated_features(v.to(device)).float() for v in (view1, view2))
    lam = float(head.kl_weight)
    heads = []
    for i, weight in enumerate([0.0] + [lam] * ENSEMBLE):
        with torch.random.fork_rng(devices=[]):  # the heads' initialisation from the seed alone
            torch.manual_seed(seed * 100 + i)
            net = mlp(view1.shape[1], cfg.proj_hidden, cfg.proj_dim, cfg.head_depth).to(device)
        _train_control(net, view1.to(device), view2.to(device), u1, u2, rate, weight, steps, batch_size, cfg,
                       torch.Generator().manual_seed(seed * 100 + i))
        heads.append(net.eval())
    return ControlHeads(heads[0], heads[1:], cfg.logit_bound)


def _train_control(net, h1, h2, u1, u2, rate, kl_weight, steps, batch_size, cfg, generator):
    optimizer = torch.optim.SGD(net.parameters(), lr=cfg.gate_lr, momentum=0.9)
    n = len(h1)
    batch_size = min(batch_size, n)
    for _ in range(steps):
        rows = torch.randperm(n, generator=generator)[:batch_size].to(h1.device)
        h, u = torch.cat([h1[rows], h2[rows]]), torch.cat([u1[rows], u2[rows]])
        p = torch.sigmoid(bound_logits(net(h), cfg.logit_bound))
        g = (p > 0.5).float() + p - p.detach()  # the `ste` estimator's value: the mode, straight-through to p
        loss = info_nce_rows(normalize(u * g), cfg.temperature).mean()
        if kl_weight:
            loss = loss + kl_weight * bernoulli_kl(p, rate, cfg.kl_clamp).sum(1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
