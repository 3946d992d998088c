"""The gate posterior of a run on its test split: which dimensions each test image uses, and how sure the model is.

``gate_posterior(run_dir_or_learner)`` answers it with the exact inclusion probabilities q(g_k = 1 | x) of the run's
gate estimator, read from the guide's logits, optionally draws of the gates from q(g | x) (a Bernoulli with those
probabilities, for every estimator: also for ``ste``, which trains on the mode), the labels, and the class x dimension
mean inclusion (``dimensions.inclusion_by_class``); with a hierarchical prior, its latents' posterior read from the
guide by site name (:func:`prior_latents`), and the prior's inclusion rate (:func:`prior_rate`), which the report and
the figures take the KL per dimension against. ``evaluate/arviz_export.py`` turns it into ArviZ data.
"""

import os
from dataclasses import dataclass

import pyro
import torch
from pyro import poutine

from bayesncl_pyro._deprecated import renamed
from bayesncl_pyro.data import DataSpec, load_dataset
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate.dimensions import inclusion_by_class
from bayesncl_pyro.evaluate.heldout import TestFeatures, test_features
from bayesncl_pyro.evaluate.loading import load_learner
from bayesncl_pyro.infer.head import own_params
from bayesncl_pyro.infer.learner import ContrastiveLearner


def prior_rate(learner, test: TestFeatures | None = None) -> torch.Tensor:
    """The prior's inclusion rate of a gated learner, on the CPU.

    K (a hierarchical prior's at its latents' posterior, ``Prior.mean_rate``), or for a prior with a rate per row
    N x K, each test image's at its posterior given the image (``Prior.row_rates``: the learner's ``test`` features
    needed).
    """
    prior, guide = learner.model.prior, learner.guide.rate_guide
    if not prior.row_latents:
        return prior.mean_rate(guide).detach().cpu()
    if test is None:
        raise UserError(f"the {learner.cfg.prior} prior has a rate per image: its rates need the test features")
    return prior.row_rates(guide, test.backbone.to(next(learner.parameters()).device)).detach().cpu()


def prior_latents(guide, num_draws: int, h: torch.Tensor | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(params, draws, row_draws)`` of the guide of a prior's latents, read from its trace by site name.

    As ``pyro.infer.Predictive`` reads a guide: its parameter sites' values (constrained, named within the guide) and
    ``num_draws`` draws of each of its latent sites (S x the site's shape; empty for 0 draws), on the CPU. With h
    (N x D, a prior with latents per image) the guide reads those images under a plate ``images`` of N, and the
    sites in it are ``row_draws`` (S x N x ...). The draws are one trace under a plate of S draws left of the guide's
    own plates (Predictive's ``parallel=True``), in a param store of its own (``own_params``).
    """
    args = () if h is None else (h, pyro.plate("images", len(h), device=h.device))
    with own_params():
        trace = poutine.trace(guide).get_trace(*args)
        prefix = f"{guide._pyro_name}." if guide._pyro_name else ""  # a submodule's params are named by its path
        params = {name.removeprefix(prefix): site["value"].detach().cpu() for name, site in trace.nodes.items()
                  if site["type"] == "param"}
        if not num_draws:
            return params, {}, {}
        nesting = max((-f.dim for name in trace.stochastic_nodes for f in trace.nodes[name]["cond_indep_stack"]),
                      default=0)
        with pyro.plate("draws", num_draws, dim=-nesting - 1):
            trace = poutine.trace(guide).get_trace(*args)
    draws, row_draws = {}, {}
    for name in trace.stochastic_nodes:
        site = trace.nodes[name]
        row = any(f.name == "images" for f in site["cond_indep_stack"])
        (row_draws if row else draws)[name] = site["value"].detach().cpu()
    return params, draws, row_draws


@dataclass
class GatePosterior:
    """N test items, K dimensions, C classes, S draws."""

    probs: torch.Tensor  # N x K, q(g_k = 1 | x_i), exact
    features: torch.Tensor  # N x K, the representation F the metrics judge (at the gate's evaluation mask)
    labels: torch.Tensor  # N, class index
    classes: list[str]  # C names, index = label
    draws: torch.Tensor | None = None  # S x N x K, 0/1 gates drawn from q(g | x) = Bernoulli(probs)
    # the prior's global latents (a hierarchical prior's), by the name of their site: S draws from their q each
    global_draws: dict[str, torch.Tensor] | None = None
    # q's parameters of the global latents, by their name in the prior's guide (beta-bernoulli: q(rate_k) =
    # Beta(a_k, b_k), as "a" and "b")
    global_params: dict[str, torch.Tensor] | None = None
    # the prior's own learned parameters by their name in it, constrained (learned: logit_rate; a mixture's weights, a
    # learned covariance of the user's)
    prior_params: dict[str, torch.Tensor] | None = None
    # where q of the global latents is and where it tends to, in one figure each (``Prior.convergence``: for
    # beta-bernoulli the concentration a + b and a0 + b0 + 2N, which a training run is far from: models/priors.py,
    # BetaBernoulliPrior); None where the prior has no such figure
    global_convergence: tuple[float, float] | None = None
    # the prior's inclusion rate (:func:`prior_rate`): K, or N x K for a prior with a rate per image
    prior_rate: torch.Tensor | None = None
    # a prior's latents per image (per-image: its rate), by the name of their site: S draws from q given the image
    row_draws: dict[str, torch.Tensor] | None = None

    @property
    def class_means(self) -> torch.Tensor:
        """C x K: the mean inclusion probability per class and dimension (:func:`inclusion_by_class`'s mean)."""
        return inclusion_by_class(self.probs, self.labels, len(self.classes))[0]

    # the beta-bernoulli fields' names before a prior's global latents were read by site name: until 0.5.0
    @property
    def rate_draws(self) -> torch.Tensor | None:
        """Deprecated: ``global_draws["rate"]``."""
        renamed("GatePosterior.rate_draws", 'GatePosterior.global_draws["rate"]')
        return (self.global_draws or {}).get("rate")

    @property
    def rate_beta(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Deprecated: ``global_params["a"], global_params["b"]``."""
        renamed("GatePosterior.rate_beta", 'GatePosterior.global_params["a"], global_params["b"]')
        params = self.global_params or {}
        return (params["a"], params["b"]) if "a" in params and "b" in params else None

    @property
    def rate_optimum_concentration(self) -> float | None:
        """Deprecated: ``global_convergence[1]``."""
        renamed("GatePosterior.rate_optimum_concentration", "GatePosterior.global_convergence[1]")
        return None if self.global_convergence is None else self.global_convergence[1]


@torch.no_grad()
def gate_posterior(source: str | os.PathLike | ContrastiveLearner, data: DataSpec | None = None,
                   num_draws: int = 0, device: str | torch.device | None = None,
                   trust_code: bool = False, test: TestFeatures | None = None) -> GatePosterior:
    """The gate posterior of a run folder (or a trained learner) on the test split.

    Args:
        source: a run folder holding ``checkpoint.pt``, or a :class:`ContrastiveLearner`.
        data: the dataset; by default the run's own (``cfg.dataset``, ``cfg.data_dir``, ``cfg.seed``).
        num_draws: gate draws per item from q(g | x), independent Bernoulli(probs) gates, whatever the
            estimator (training's value is another matter: ``ste`` trains on the mode); 0 = only the
            exact probabilities.
        device: where to compute; by default the learner's own device (cpu for a run folder).
        trust_code: import the code that a run folder's configuration names (``evaluate.loading.load_learner``).
        test: this learner's :func:`test_features` of ``data``, when the caller has them (the evaluation's):
            the backbone is not run again.

    Returns:
        The posterior on the N test items: ``probs`` (N x K, exact), ``features`` (the representation at the
        evaluation mask), ``labels``, ``classes``; with ``num_draws``, ``draws`` (num_draws x N x K) and a
        hierarchical prior's draws of its latents (``global_draws``, ``row_draws``).

    Raises:
        UserError: the run has no gates, or ``num_draws`` is negative.

    Examples:
        >>> post = gate_posterior(run_dir, num_draws=8)  # or a trained learner
        >>> post.probs.shape, post.draws.shape  # 360 test images, K = 16
        (torch.Size([360, 16]), torch.Size([8, 360, 16]))
        >>> post.class_means.shape  # C x K: the mean inclusion per class
        torch.Size([10, 16])
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
    if test is None:
        data = data or load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed, holdout=cfg.holdout_cells)
        test = test_features(learner, data, device)
    post = GatePosterior(probs=test.probs, features=test.features, labels=test.labels, classes=test.classes)
    if num_draws:
        # sample(), not the guide's pyro.sample (rsample: the value training uses, the mode for ste)
        post.draws = learner.guide.posterior(test.backbone.to(device)).sample((num_draws,)).cpu()
    rate_guide, prior = learner.guide.rate_guide, learner.model.prior
    if rate_guide is not None:
        h = test.backbone.to(device) if prior.row_latents else None
        post.global_params, draws, row_draws = prior_latents(rate_guide, num_draws, h)
        post.global_draws, post.row_draws = draws or None, row_draws or None
        post.global_convergence = prior.convergence(rate_guide, learner.head.num_rows)
    post.prior_params = learned_parameters(prior) or None
    post.prior_rate = prior_rate(learner, test)
    return post


def learned_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's parameters by name, detached on the CPU; a PyroParam by its own name, in its constrained space."""
    out = {}
    for name, value in module.named_parameters():
        path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(path) if path else module
        base = leaf.removesuffix("_unconstrained")
        if base != leaf and base in getattr(owner, "_pyro_params", {}):
            leaf, value = base, getattr(owner, base)  # outside a Pyro context: the constrained value, no param store
        out[f"{path}.{leaf}" if path else leaf] = value.detach().cpu()
    return out
