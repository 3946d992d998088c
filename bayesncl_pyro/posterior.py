"""The gate posterior of a trained BayesNCL run, on the test split, as plain tensors.

``gate_posterior(run_dir_or_learner)`` answers "which dimensions does each test image use, and how
sure is the model?": the exact inclusion probabilities q(g_k = 1 | x) of the run's gate estimator, read
from the guide's logits, optionally draws of the gates from the variational posterior q(g | x) (a
Bernoulli with those probabilities, for every estimator: also for ``ste``, which trains on the mode), the
labels, and the class x dimension mean inclusion. ``bayesncl_pyro/arviz_export.py`` turns the result into
ArviZ data.
"""

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bayesncl_pyro.data import DataSpec, load_dataset
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluation import extract
from bayesncl_pyro.learner import ContrastiveLearner
from bayesncl_pyro.models.priors import BetaBernoulliPrior
from bayesncl_pyro.rundir import load_learner


@dataclass
class GatePosterior:
    """N test items, K dimensions, C classes, S draws."""

    probs: torch.Tensor  # N x K, q(g_k = 1 | x_i), exact
    features: torch.Tensor  # N x K, the representation F the metrics judge (at the gate's evaluation mask)
    labels: torch.Tensor  # N, class index
    classes: list[str]  # C names, index = label
    draws: torch.Tensor | None = None  # S x N x K, 0/1 gates drawn from q(g | x) = Bernoulli(probs)
    rate_draws: torch.Tensor | None = None  # S x K, draws of the global rate from q(rate) (beta-bernoulli only)
    rate_beta: tuple[torch.Tensor, torch.Tensor] | None = None  # (a, b), K each: q(rate_k) = Beta(a_k, b_k)
    # a0 + b0 + 2N, the concentration of the conjugate posterior that q(rate) tends to (and is far from after a
    # training run: models/priors.py, BetaBernoulliPrior)
    rate_optimum_concentration: float | None = None

    @property
    def class_means(self) -> torch.Tensor:
        """C x K mean inclusion probability of each dimension over the items of each class."""
        one_hot = F.one_hot(self.labels, len(self.classes)).to(self.probs)
        return (one_hot.T @ self.probs) / one_hot.sum(0).clamp_min(1)[:, None]


@torch.no_grad()
def gate_posterior(source: str | os.PathLike | ContrastiveLearner, data: DataSpec | None = None,
                   num_draws: int = 0, device: str | torch.device | None = None,
                   trust_code: bool = False) -> GatePosterior:
    """The gate posterior of a run folder (or a trained learner) on the test split.

    Args:
        source: a run folder holding ``checkpoint.pt``, or a :class:`ContrastiveLearner`.
        data: the dataset; by default the run's own (``cfg.dataset``, ``cfg.data_dir``, ``cfg.seed``).
        num_draws: gate draws per item from q(g | x), independent Bernoulli(probs) gates, whatever the
            estimator (training's value is another matter: ``ste`` trains on the mode); 0 = only the
            exact probabilities.
        device: where to compute; by default the learner's own device (cpu for a run folder).
        trust_code: import the code that a run folder's configuration names (``rundir.load_learner``).
    """
    if isinstance(source, ContrastiveLearner):
        learner = source if device is None else source.to(device)
    else:
        learner, _ = load_learner(source, device or "cpu", trust_code=trust_code)
    device = next(learner.parameters()).device
    cfg = learner.cfg
    if not learner.gated:
        raise UserError(f"a {cfg.method} run has no gates; the gate posterior needs a bayesncl run")
    if num_draws < 0:
        raise UserError(f"the number of gate draws must not be negative, got {num_draws}")
    data = data or load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed)
    h, features, labels = extract(learner, data.test, cfg, data.channels, device)
    h = h.to(device)
    q = learner.guide.posterior(h)
    post = GatePosterior(probs=q.probs.cpu(), features=features, labels=labels, classes=list(data.classes))
    rate_guide = learner.guide.rate_guide
    if isinstance(learner.model.prior, BetaBernoulliPrior):  # another hierarchical prior has its own q(rate)
        post.rate_beta = (rate_guide.a.detach().cpu(), rate_guide.b.detach().cpu())
        post.rate_optimum_concentration = learner.model.prior.optimum_concentration(learner.head.num_rows)
    if num_draws:
        # sample(), not the guide's pyro.sample (rsample: the value training uses, the mode for ste)
        post.draws = q.sample((num_draws,)).cpu()
        if rate_guide is not None:
            post.rate_draws = rate_guide.posterior().sample((num_draws,)).cpu()
    return post
