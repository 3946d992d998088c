"""Novelty scores: a number per image, larger for "more novel", each read from one trained run.

``SCORES`` says each in a line; by what they read:

* **from the posterior** (a gated run): the per-image KL(q(g | x) || p(g)) of a variational bottleneck (Alemi et al.
  2018), the gates' entropy, and over ``DRAWS`` draws g ~ q(g | x) the mutual information of a linear probe's class
  prediction with g (BALD) and its predictive entropy marginalised over q; with a Bayesian gating head
  (``--gate-head bayesian``), the mutual information of the gates with the head's weights over draws of W ~ q(W) and
  the spread of q(g | x, W) across them;
* **deterministic, on the same run's features** (every run): a linear probe's max-softmax and energy, kNN distance
  (Sun et al. 2022) and class-conditional Mahalanobis distance (Lee et al. 2018), each on the backbone's features h and
  on the representation F the method uses (``pytorch_ood.detector``'s ``MaxSoftmax``, ``EnergyBased``, ``KNN``,
  ``Mahalanobis``); and for a run that selects features (gates or TopK) post-hoc TopK's margin (how close the k-th
  and (k+1)-th largest ungated features are) and the atypicality of the TopK active set against the most typical
  class's (``TOPK_SCORES``);
* **controls fitted on the run's frozen backbone** (``control_*``, a gated run): gating heads trained with the KL
  weight at 0, at the run's lambda, and an ensemble of them (``novelty_controls``). They decide whether the *Bayesian*
  part adds anything: a KL-0 head is a gating head with no prior.

The linear probes are the evaluation's (``probe.train_linear`` with ``FAST_PROBE``, standardised features) on the
training split: one on h, one on F (at the evaluation mask); BALD and the predictive entropy push draws of F through
the probe on F. How well each score flags a novel set is ``novelty_detection``'s; which comparison answers the
question across seeds is declared in ``novelty`` (``PRIMARY``).
"""

import torch
import torch.nn.functional as F

from bayesncl_pyro.evaluate.novelty_controls import ControlHeads, marginal_rate
from bayesncl_pyro.evaluate.probe import FAST_PROBE, standardised, train_linear
from bayesncl_pyro.nn.losses import bernoulli_kl, normalize

DRAWS = 32
"""S, the draws of g ~ q(g | x) (and of W ~ q(W), for a Bayesian head) behind the sampled scores."""

NEAREST_K = 50
"""k of the kNN distance: Sun et al.'s choice for CIFAR-10 (pytorch-ood's default)."""

SCORES = {
    "kl_prior": "posterior: KL(q(g | x) || p(g)) summed over the K gates, exact (the prior at its marginal rates)",
    "gate_entropy": "posterior: the entropy of q(g | x), summed over the K gates",
    "bald": "posterior: mutual information of the F-probe's class prediction with g over S draws g ~ q(g | x)",
    "predictive_entropy": "posterior: entropy of the F-probe's class prediction averaged over S draws g ~ q(g | x)",
    "weight_mi": "Bayesian head: mutual information of the gates with the head's weights over S draws W ~ q(W)",
    "q_spread": "Bayesian head: sd of q(g = 1 | x, W) over S draws W ~ q(W), averaged over the K gates",
    "msp_backbone": "deterministic: minus the max softmax of the linear probe on h",
    "energy_backbone": "deterministic: minus the log-sum-exp of the linear probe's logits on h (energy)",
    "knn_backbone": "deterministic: distance of normalised h to its k-th nearest training image",
    "mahalanobis_backbone": "deterministic: Mahalanobis distance of h to the nearest class mean (shared covariance)",
    "msp_representation": "deterministic: minus the max softmax of the linear probe on F",
    "energy_representation": "deterministic: minus the log-sum-exp of the linear probe's logits on F",
    "knn_representation": "deterministic: distance of normalised F to its k-th nearest training image",
    "mahalanobis_representation": "deterministic: Mahalanobis distance of F to the nearest class mean",
    "topk_margin": "deterministic: minus the gap between the k-th and (k+1)-th largest ungated features (k: the "
                   "image's open gates, or the run's --topk)",
    "topk_atypicality": "deterministic: the TopK active set's mean Bernoulli surprisal under the most typical class's "
                        "frequencies of each dim being active (training split)",
    "control_kl0_kl_prior": "control: kl_prior of a gating head trained with the KL weight at 0 (frozen backbone)",
    "control_kl0_gate_entropy": "control: gate_entropy of that KL-0 head",
    "control_refit_kl_prior": "control: kl_prior of a gating head trained at the run's lambda on the frozen backbone",
    "control_refit_gate_entropy": "control: gate_entropy of that head",
    "control_ensemble_mi": "control: mutual information of the gates with the member, over an ensemble of 5 heads",
    "control_ensemble_spread": "control: sd of q(g = 1 | x) across the ensemble's members, averaged over the gates",
}
"""Every novelty score by name, in a line: what eval.json's ``novelty`` and ``TrainedRun.novelty`` hold."""

POSTERIOR_SCORES = ("kl_prior", "gate_entropy", "bald", "predictive_entropy")
EPISTEMIC_SCORES = ("weight_mi", "q_spread")
TOPK_SCORES = ("topk_margin", "topk_atypicality")


def binary_entropy(p: torch.Tensor) -> torch.Tensor:
    """H(Bernoulli(p)) in nats, elementwise, 0 at p in {0, 1}."""
    return -(torch.xlogy(p, p) + torch.xlogy(1 - p, 1 - p))


def categorical_entropy(p: torch.Tensor) -> torch.Tensor:
    """H of each row of class probabilities (... x C), in nats."""
    return -torch.xlogy(p, p).sum(-1)


def mutual_information(probs: torch.Tensor) -> torch.Tensor:
    """S x N x K Bernoulli probabilities over S draws of what they depend on -> N: sum_k H(mean_s p) - mean_s H(p)."""
    return (binary_entropy(probs.mean(0)) - binary_entropy(probs).mean(0)).sum(-1)


def topk_mask(features: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """N x K 0/1: each row's ``k[i]`` largest entries (ties by index), ``k`` an N-long count."""
    order = features.argsort(dim=1, descending=True, stable=True)
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(features.shape[1]).expand_as(order))
    return (ranks < k[:, None]).float()


def topk_margin(features: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """N: minus the gap between each row's k-th and (k+1)-th largest entries (an unsure selection scores high)."""
    ranked = features.sort(dim=1, descending=True).values
    k = k.clamp(1, features.shape[1] - 1)[:, None]
    return -(ranked.gather(1, k - 1) - ranked.gather(1, k)).squeeze(1)


def active_set_frequencies(active: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """C x K: per class, the share of its images whose active set holds each dim (Laplace-smoothed, in (0, 1))."""
    onehot = F.one_hot(labels, num_classes).float()
    return (onehot.T @ active + 1) / (onehot.sum(0)[:, None] + 2)


def atypicality(active: torch.Tensor, frequencies: torch.Tensor) -> torch.Tensor:
    """N: the active set's mean Bernoulli surprisal per dim under the most typical class's frequencies (C x K)."""
    surprisal = -(active @ frequencies.log().T + (1 - active) @ (1 - frequencies).log().T) / active.shape[1]
    return surprisal.min(dim=1).values


class _Probe:
    """A linear probe trained on the training split's features (``FAST_PROBE``), as a map to logits."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, num_classes: int, seed: int):
        self.train_x = x.float()
        self.linear = train_linear(self.train_x, y, num_classes, FAST_PROBE, seed=seed)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(standardised(x.float(), self.train_x))


def _distance_detectors(x: torch.Tensor, y: torch.Tensor):
    from pytorch_ood.detector import KNN, Mahalanobis  # late: only an evaluation needs it

    return (KNN(None, k=min(NEAREST_K, len(x))).fit_features(x.float(), y),
            Mahalanobis(None).fit_features(x.float(), y))


class NoveltyScorer:
    """Every novelty score of one trained learner, fitted on its training split's backbone features.

    Args:
        learner: a trained ``ContrastiveLearner`` (any method; the posterior scores need gates).
        train_h: N x D backbone features of the training split (eval transform); train_y: their labels.
        num_classes: C.
        seed: the probes' seed.
        controls: :class:`ControlHeads` of the run (or None: no ``control_*`` scores).
        draws: S (``DRAWS``).
    """

    def __init__(self, learner, train_h: torch.Tensor, train_y: torch.Tensor, num_classes: int, seed: int = 0,
                 controls: ControlHeads | None = None, draws: int = DRAWS):
        self.learner, self.controls, self.draws, self.seed = learner, controls, draws, seed
        self.device = next(learner.parameters()).device
        train_h = train_h.float()
        train_f = self._representation(train_h)
        self.probe_h, self.probe_f = (_Probe(x, train_y, num_classes, seed) for x in (train_h, train_f))
        self.knn_h, self.maha_h = _distance_detectors(train_h, train_y)
        self.knn_f, self.maha_f = _distance_detectors(train_f, train_y)
        head = learner.head
        self.selects = head.gated or head.model.topk > 0
        if self.selects:
            active = topk_mask(self._ungated(train_h), self._k(train_h))
            self.frequencies = active_set_frequencies(active, train_y, num_classes)

    def _on(self, h):
        return h.to(self.device)

    def _representation(self, h):
        return self.learner.head.representation(self._on(h)).float().cpu()

    def _ungated(self, h):
        return self.learner.head.ungated_features(self._on(h)).float().cpu()

    def _k(self, h) -> torch.Tensor:
        """Each row's TopK size: its open evaluation gates (gated), else the run's --topk."""
        head = self.learner.head
        if head.gated:
            return head.gate_mask(self._on(h)).sum(1).long().cpu()
        return torch.full((len(h),), head.model.topk, dtype=torch.long)

    @torch.no_grad()
    def _prior_rate(self, h) -> torch.Tensor:
        """N x K: the prior's marginal inclusion rate for each row (its latents at their posterior)."""
        prior, guide = self.learner.model.prior, self.learner.guide.rate_guide
        if prior.row_latents:
            return prior.row_rates(guide, self._on(h)).float().cpu()
        return prior.mean_rate(guide).float().cpu().expand(len(h), -1)

    @torch.no_grad()
    def __call__(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every score this run has (``SCORES``), name -> N values (larger: more novel), from backbone features h."""
        from pytorch_ood.detector import EnergyBased, MaxSoftmax  # late: as in _distance_detectors

        h = h.float()
        f = self._representation(h)
        logits_h, logits_f = self.probe_h(h), self.probe_f(f)
        out = dict(msp_backbone=MaxSoftmax.score(logits_h), energy_backbone=EnergyBased.score(logits_h),
                   knn_backbone=self.knn_h.predict_features(h), mahalanobis_backbone=self.maha_h.predict_features(h),
                   msp_representation=MaxSoftmax.score(logits_f), energy_representation=EnergyBased.score(logits_f),
                   knn_representation=self.knn_f.predict_features(f),
                   mahalanobis_representation=self.maha_f.predict_features(f))
        if self.selects:  # every gated run selects: its ungated features serve the posterior's scores too
            ungated, k = self._ungated(h), self._k(h)
            out.update(topk_margin=topk_margin(ungated, k),
                       topk_atypicality=atypicality(topk_mask(ungated, k), self.frequencies))
        head = self.learner.head
        if head.gated:
            out.update(self._posterior(h, ungated))
            if head.guide.bayesian:
                probs = head.guide.weight_probs(self._on(h), self.draws).float().cpu()
                out.update(weight_mi=mutual_information(probs), q_spread=probs.std(0).mean(1))
            if self.controls is not None:
                out.update(self._controls(h))
        return {name: v.double().cpu() for name, v in out.items()}

    def _posterior(self, h, ungated) -> dict[str, torch.Tensor]:
        head = self.learner.head
        probs = head.gate_probs(self._on(h)).float().cpu()
        rate = self._prior_rate(h)
        generator = torch.Generator().manual_seed(self.seed)
        predictions = torch.stack([
            self.probe_f(normalize(ungated * torch.bernoulli(probs, generator=generator))).softmax(-1)
            for _ in range(self.draws)])
        marginal = categorical_entropy(predictions.mean(0))
        return dict(kl_prior=bernoulli_kl(probs, rate, 0.0).sum(1), gate_entropy=binary_entropy(probs).sum(1),
                    bald=marginal - categorical_entropy(predictions).mean(0), predictive_entropy=marginal)

    def _controls(self, h) -> dict[str, torch.Tensor]:
        c = self.controls
        on = self._on(h)
        rate = marginal_rate(self.learner).cpu().expand(len(h), -1)
        kl0, members = c.probs(c.kl0, on).cpu(), torch.stack([c.probs(m, on).cpu() for m in c.ensemble])
        return dict(control_kl0_kl_prior=bernoulli_kl(kl0, rate, 0.0).sum(1),
                    control_kl0_gate_entropy=binary_entropy(kl0).sum(1),
                    control_refit_kl_prior=bernoulli_kl(members[0], rate, 0.0).sum(1),
                    control_refit_gate_entropy=binary_entropy(members[0]).sum(1),
                    control_ensemble_mi=mutual_information(members), control_ensemble_spread=members.std(0).mean(1))
