"""Novelty: does the gate posterior q(g | x) flag images unlike the training data, better than deterministic scores?

Every score is a number per image, larger for "more novel"; each is judged by how well it separates a novel set from
the in-distribution test split (:func:`detection`: AUROC, FPR at 95 % TPR and AUPR with the novel images positive, by
``pytorch_ood.metrics.OODMetrics``). The scores, by what they read (``SCORES`` says each in a line):

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
* **controls fitted on the run's frozen backbone** (``control_*``, a gated run): the same gating head trained with
  the KL weight at 0 (``control_kl0_*``), one trained at the run's lambda (``control_refit_*``, the first of an
  ensemble), and the ensemble of ``ENSEMBLE`` such heads (``control_ensemble_*``: the mutual information of the gates
  with the member and the spread of q across members), each trained on one pass of two augmented views of the training
  split through the frozen backbone and projector (:func:`fit_control_heads`). They decide whether the *Bayesian* part
  adds anything: a KL-0 head is a gating head with no prior.

The linear probes are the evaluation's (``probe.train_linear`` with ``FAST_PROBE``, standardised features) on the
training split: one on h, one on F (at the evaluation mask); BALD and the predictive entropy push draws of F through
the probe on F. Which comparison answers the question is declared here, before any run (``PRIMARY``).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bayesncl_pyro.evaluate.probe import FAST_PROBE, standardised, train_linear
from bayesncl_pyro.evaluate.stats import mean_sd
from bayesncl_pyro.nn.encoders import mlp
from bayesncl_pyro.nn.losses import bernoulli_kl, info_nce_rows, normalize

DRAWS = 32
"""S, the draws of g ~ q(g | x) (and of W ~ q(W), for a Bayesian head) behind the sampled scores."""

NEAREST_K = 50
"""k of the kNN distance: Sun et al.'s choice for CIFAR-10 (pytorch-ood's default)."""

ENSEMBLE = 5
"""Gating heads in the ensemble control."""

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

PRIMARY = dict(novel_set="new-shapes", metric="auroc", score="kl_prior",
               baselines=("knn_backbone", "mahalanobis_backbone", "msp_backbone", "topk_atypicality",
                          "control_kl0_kl_prior"),
               margin=0.02)
"""The question, declared before the runs: on new shapes (semantic novelty), is the posterior's per-image KL's AUROC
above each deterministic baseline of the same run (kNN and Mahalanobis on h, the probe's max-softmax, TopK's
atypicality) and above the same head trained with no KL? Paired by seed; one Holm family over the five differences and
their five equivalence tests (TOST within +/- ``margin`` of AUROC)."""


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


@dataclass
class ControlHeads:
    """Gating heads trained on a run's frozen backbone (:func:`fit_control_heads`): the KL-0 head and the ensemble."""

    kl0: torch.nn.Module
    ensemble: list[torch.nn.Module]
    logit_bound: float

    @torch.no_grad()
    def probs(self, head: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        """q(g = 1 | x) of one control head at backbone features h (N x K)."""
        b = self.logit_bound
        return torch.sigmoid(b * torch.tanh(head(h.float()) / b))


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
    b, n = cfg.logit_bound, len(h1)
    batch_size = min(batch_size, n)
    for _ in range(steps):
        rows = torch.randperm(n, generator=generator)[:batch_size].to(h1.device)
        h, u = torch.cat([h1[rows], h2[rows]]), torch.cat([u1[rows], u2[rows]])
        p = torch.sigmoid(b * torch.tanh(net(h) / b))
        g = (p > 0.5).float() + p - p.detach()
        loss = info_nce_rows(normalize(u * g), cfg.temperature).mean()
        if kl_weight:
            loss = loss + kl_weight * bernoulli_kl(p, rate, cfg.kl_clamp).sum(1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def detection(in_scores: dict[str, torch.Tensor], novel_scores: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Per score, how well it separates a novel set (positive) from the in-distribution images.

    ``auroc``, ``fpr95`` (the share of in-distribution images flagged at the threshold that flags 95 % of the novel
    ones), ``aupr`` (novel images positive: AUPR-OUT) by ``pytorch_ood.metrics.OODMetrics``; and ``flagged``, the share
    of the novel set above the in-distribution split's 95th percentile (a nuisance set's false-alarm rate there, about
    0.05 for a score blind to the shift).
    """
    from pytorch_ood.metrics import OODMetrics  # late: as in _distance_detectors

    out = {}
    for name, novel in novel_scores.items():
        known = in_scores[name]
        scores = torch.cat([known, novel]).double()
        labels = torch.cat([torch.zeros(len(known)), -torch.ones(len(novel))]).long()
        if not torch.isfinite(scores).all():
            out[name] = dict(auroc=math.nan, fpr95=math.nan, aupr=math.nan, flagged=math.nan)
            continue
        metrics = OODMetrics()
        metrics.update(scores, labels)
        m = metrics.compute()
        threshold = torch.quantile(known.double(), 0.95)
        out[name] = dict(auroc=float(m["AUROC"]), fpr95=float(m["FPR95TPR"]), aupr=float(m["AUPR-OUT"]),
                         flagged=float((novel > threshold).double().mean()))
    return out


def report(in_scores: dict[str, torch.Tensor], novel: dict[str, dict[str, torch.Tensor]],
           kinds: dict[str, str]) -> dict:
    """eval.json's ``novelty``: per novel set its kind, size and each score's :func:`detection`.

    With at least one semantic and one nuisance set, also ``full_spectrum``: the semantic sets against the
    in-distribution split and the nuisance sets together (OpenOOD v1.5's full-spectrum setting, where a nuisance
    shift counts as known).
    """
    sets = {name: dict(kind=kinds.get(name, "semantic"), n=len(next(iter(scores.values()))),
                       scores=detection(in_scores, scores)) for name, scores in novel.items()}
    out = dict(sets=sets, draws=DRAWS, definitions={k: SCORES[k] for k in in_scores})
    semantic = [n for n in novel if kinds.get(n) == "semantic"]
    nuisance = [n for n in novel if kinds.get(n) == "nuisance"]
    if semantic and nuisance:
        known = {k: torch.cat([in_scores[k]] + [novel[n][k] for n in nuisance]) for k in in_scores}
        positive = {k: torch.cat([novel[n][k] for n in semantic]) for k in in_scores}
        out["full_spectrum"] = dict(semantic=semantic, nuisance=nuisance, scores=detection(known, positive))
    return out


def paired(runs: list[dict], primary: dict = PRIMARY) -> list[dict]:
    """The declared comparisons of :data:`PRIMARY`, paired by seed within each gated method's runs.

    ``runs``: eval dicts with ``name`` (the method's), ``seed`` and ``novelty``. For each method, each baseline: the
    primary score's metric minus the baseline's on the primary novel set, one difference a seed (the same run's images
    scored both ways), with ``stats.interval``'s mean, intervals, bounds and TOST at ``primary["margin"]``; then Holm's
    adjustment over the family of every difference's p and every TOST p of that method together (``holm_p``,
    ``holm_tost_p``).
    """
    from bayesncl_pyro.evaluate.stats import holm, interval  # late: scipy, only a comparison needs it

    rows = []
    methods = dict.fromkeys(r["name"] for r in runs if primary["score"] in _scores(r, primary))
    for method in methods:
        mine = [r for r in runs if r["name"] == method and primary["score"] in _scores(r, primary)]
        family = []
        for baseline in primary["baselines"]:
            pairs = [(_scores(r, primary)[primary["score"]], _scores(r, primary).get(baseline)) for r in mine]
            diffs = [a[primary["metric"]] - b[primary["metric"]] for a, b in pairs if b is not None]
            if diffs:
                family.append(dict(method=method, score=primary["score"], baseline=baseline,
                                   novel_set=primary["novel_set"], metric=primary["metric"],
                                   **interval(diffs, margin=primary["margin"])))
        ps = [row.get("p", math.nan) for row in family] + [row.get("tost_p", math.nan) for row in family]
        if family and not any(math.isnan(p) for p in ps):
            adjusted = holm(ps)
            for i, row in enumerate(family):
                row.update(holm_p=adjusted[i], holm_tost_p=adjusted[len(family) + i])
        rows += family
    return rows


def _scores(run: dict, primary: dict) -> dict:
    return run.get("novelty", {}).get("sets", {}).get(primary["novel_set"], {}).get("scores", {})


def summary(runs: list[dict]) -> dict:
    """Per method, per novel set and score: the mean and sd over seeds of AUROC, FPR95 and the share flagged."""
    out = {}
    for method in dict.fromkeys(r["name"] for r in runs if "novelty" in r):
        mine = [r["novelty"] for r in runs if r["name"] == method and "novelty" in r]
        sets = {}
        for name in mine[0]["sets"]:
            scores = {}
            for score in mine[0]["sets"][name]["scores"]:
                values = {m: [n["sets"][name]["scores"][score][m] for n in mine if score in n["sets"].get(name, {}).get(
                    "scores", {})] for m in ("auroc", "fpr95", "flagged")}
                scores[score] = {m: mean_sd(v) for m, v in values.items()}
            sets[name] = dict(kind=mine[0]["sets"][name]["kind"], scores=scores)
        out[method] = dict(seeds=len(mine), sets=sets)
    return out


def markdown(summary_: dict, rows: list[dict]) -> list[str]:
    """comparison.md's novelty section: each method's AUROC per score and set, then the declared paired comparisons."""
    md = []
    for method, s in summary_.items():
        sets = list(s["sets"])
        head = ["score"] + [f"{n} ({s['sets'][n]['kind']})" for n in sets]
        md += ["", f"Novelty, {method} ({s['seeds']} seeds): AUROC against the in-distribution test split, mean ± sd "
               "over seeds (a semantic set is to be flagged: 1 is perfect; a nuisance set changes no class: a score "
               "that follows the class stays near 0.5, and the share it flags at the test split's 95th percentile, "
               "in brackets, near 0.05).", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for score in s["sets"][sets[0]]["scores"]:
            cells = [score]
            for n in sets:
                m = s["sets"][n]["scores"].get(score)
                if m is None:
                    cells.append("")
                    continue
                (a, sd), (f, _) = m["auroc"], m["flagged"]
                cells.append(f"{a:.3f} ± {sd:.3f}" + (f" [{f:.2f}]" if s["sets"][n]["kind"] == "nuisance" else ""))
            md.append("| " + " | ".join(cells) + " |")
    if rows:
        p = rows[0]
        md += ["", f"The declared question (evaluate/novelty.py, PRIMARY): on {p['novel_set']}, the {p['metric']} of "
               f"{p['score']} minus each baseline's, paired by seed; 95 % t interval, one-sided 95 % bounds, TOST "
               f"within ± {PRIMARY['margin']:g}, the minimum detectable difference at 80 % power, and Holm's "
               "adjustment over the differences' and the equivalence tests' p values together.", "",
               "| method | baseline | n | mean | 95 % interval | bounds | TOST p | MDD | p | Holm p | Holm TOST p |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if "t_low" not in r:
                md.append(f"| {r['method']} | {r['baseline']} | {r['n']} | {r['mean']:+.3f} | | | | | | | |")
                continue
            md.append(f"| {r['method']} | {r['baseline']} | {r['n']} | {r['mean']:+.3f} | [{r['t_low']:+.3f}, "
                      f"{r['t_high']:+.3f}] | {r['bound_low']:+.3f}, {r['bound_high']:+.3f} | {r['tost_p']:.3f} | "
                      f"{r['mdd']:.3f} | {r['p']:.3f} | {r.get('holm_p', math.nan):.3f} | "
                      f"{r.get('holm_tost_p', math.nan):.3f} |")
    return md
