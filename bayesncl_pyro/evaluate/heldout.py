"""Evaluation of a trained learner on the held-out split.

Linear probe, kNN, interpretability metrics; and the test split's features, from one pass of the backbone
(``test_features``), which the evaluation, the gate posterior (``posterior.gate_posterior``) and the report read.

Two protocols (``Config.eval_protocol``) differ in the linear probe and retrieval only: ``fast``, for small
runs, and ``reference``, the paper's, which its published numbers were measured with (docs/METHOD.md,
"Evaluation protocols"). Every eval dict names its protocol.
"""

from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Subset

from bayesncl_pyro.config import Config
from bayesncl_pyro.data.compositional import NOVEL_KINDS
from bayesncl_pyro.data.views import TwoViews, collate_views, eval_transform, simclr_transform
from bayesncl_pyro.errors import printable
from bayesncl_pyro.evaluate import keys, novelty_controls, novelty_detection, novelty_scores
from bayesncl_pyro.evaluate.dci import dci
from bayesncl_pyro.evaluate.diagnostics import conflict_by_factor, conflict_table
from bayesncl_pyro.evaluate.matched import (
    CONTROLS,
    DEFINITIONS,
    MASK_OVERLAP,
    count_matched_controls,
    posterior_representations,
    random_mask_null,
)
from bayesncl_pyro.evaluate.metrics import (
    closed_share,
    factor_tracking,
    interpretability_metrics,
    retrieval_precision,
    topn_chance,
    topn_size,
)
from bayesncl_pyro.evaluate.probe import FAST_PROBE, REFERENCE_PROBES, ProbeRecipe, knn_top1, linear_probe
from bayesncl_pyro.loggers import Progress

REFERENCE_RETRIEVAL_DIMS = 512
"""The reference retrieves on the strongest dims, in a sweep of 32, 64, ..., 512 of them; we report its last
row (all dims when K <= 512)."""


def protocol(name: str, dataset: str) -> tuple[ProbeRecipe, int | None]:
    """(linear-probe recipe, dims kept for retrieval: None = every dim in use) of an evaluation protocol."""
    if name == "fast":
        return FAST_PROBE, None
    return REFERENCE_PROBES[dataset], REFERENCE_RETRIEVAL_DIMS


def describe_protocol(name: str, dataset: str) -> str:
    """The protocol in one line, for the tables it produced."""
    probe, num_dims = protocol(name, dataset)
    schedule = (f"{probe.warmup_epochs:g} warm-up epochs then " if probe.warmup_epochs else "") + (
        "cosine" if probe.cosine else "constant")
    retrieval = "every dim in use" if num_dims is None else f"the {num_dims} strongest dims (all, when fewer)"
    return (f"{name}: linear probe on {'standardised' if probe.standardise else 'raw'} backbone features, "
            f"{probe.optimizer.upper()} lr {probe.lr:g} (batch {probe.batch_size}, {schedule}), {probe.epochs} "
            f"epochs; retrieval on {retrieval}")


class _Transformed(torch.utils.data.Dataset):
    def __init__(self, dataset, transform):
        self.dataset, self.transform = dataset, transform

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        image, label = self.dataset[i]
        return self.transform(image), label


@torch.no_grad()
def extract(learner, dataset, cfg: Config, channels: int, device,
            progress: Progress | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backbone features, representation and labels of a dataset, in eval mode.

    Returns (h: N x D backbone features, F: N x K the method's representation, labels: N); ``progress``
    (``progress.reporter``) shows the batches go by.
    """
    learner.eval()
    loader = DataLoader(_Transformed(dataset, eval_transform(cfg.image_size, channels)),
                        batch_size=max(cfg.batch_size, 256), num_workers=cfg.workers)
    hs, fs, ys = [], [], []
    what = f"features of {len(dataset)} images"
    batches = loader if progress is None else progress(loader, len(loader), what, "batch")
    for x, y in batches:
        h, f = learner.representation(x.to(device))
        hs.append(h.cpu())
        fs.append(f.cpu())
        ys.append(y)
    return torch.cat(hs), torch.cat(fs), torch.cat(ys)


@dataclass
class TestFeatures:
    """A trained run's view of its test split, from one pass of its backbone (:func:`test_features`)."""

    features: torch.Tensor  # N x K, F: the representation the method uses (at the evaluation mask, for BayesNCL)
    labels: torch.Tensor  # N, class index
    classes: list[str]  # C names, index = label
    ungated: torch.Tensor | None = None  # N x K, BayesNCL: the same model's features with every gate open
    probs: torch.Tensor | None = None  # N x K, BayesNCL: q(g_k = 1 | x_i), exact
    mask: torch.Tensor | None = None  # N x K 0/1, BayesNCL: the evaluation gates F uses
    factors: dict[str, torch.Tensor] | None = None  # generated data: ground-truth factor -> N values
    backbone: torch.Tensor | None = None  # N x D, h: the backbone features all of the above come from

    @property
    def gated(self) -> bool:
        """Whether the features come from a gated learner."""
        return self.probs is not None

    @property
    def num_classes(self) -> int:
        """The number of classes."""
        return len(self.classes)


@torch.no_grad()
def test_features(learner, data, device: str | torch.device | None = None,
                  progress: Progress | None = None) -> TestFeatures:
    """The test split's features through a trained learner, from one pass of its backbone.

    Through :func:`extract`: h, F and, for a gated learner, its ungated features, inclusion probabilities and evaluation
    mask (through the learner's API: ``ungated_features``, ``gate_probs``, ``head.gate_mask``), all on the CPU;
    ``device``: where to compute (default: the learner's). The evaluation, the gate posterior and the report all read
    this one pass.
    """
    device = device or next(learner.parameters()).device
    h, f, labels = extract(learner, data.test, learner.cfg, data.channels, device, progress)
    out = TestFeatures(f, labels, list(data.classes), factors=getattr(data.test, "factors", None), backbone=h)
    if learner.gated:
        on_device = h.to(device)
        out.ungated, out.probs, out.mask = (x.float().cpu() for x in (
            learner.ungated_features(on_device), learner.gate_probs(on_device), learner.head.gate_mask(on_device)))
    return out


OBJECTIVE_DRAWS = 8  # draws of q(g | x) per test batch for the test-split ELBO


@torch.no_grad()
def test_objective(learner, dataset, cfg: Config, channels: int, device, draws: int = OBJECTIVE_DRAWS) -> dict:
    """The training objective on the test split, as an ELBO.

    Whatever the gate estimator trained: per row, averaged over batches of ``cfg.batch_size`` test images (InfoNCE
    depends on the batch: the training batch size, in a fixed random order, two views each drawn by the training
    augmentation with the run's seed), in eval mode.

    Returns ``test_neg_elbo`` (-ELBO per row: E_q[InfoNCE] + lambda * KL(q || p), the exact KL, from ``draws``
    draws of g ~ q(g | x) per batch: not at the mode), ``test_nce`` (its E_q[InfoNCE] term), ``test_kl`` (its KL
    per row, summed over the gates; 0 without gates) and ``test_nce_mode`` (InfoNCE of the evaluation's
    representation F: at the evaluation mask). For NCL and CL, -ELBO is the InfoNCE of their features, on the same
    batches.
    """
    learner.eval()
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    views = Subset(TwoViews(dataset, simclr_transform(cfg.image_size, channels), cfg.seed), order)
    loader = DataLoader(views, batch_size=min(cfg.batch_size, len(dataset)), drop_last=True,
                        num_workers=cfg.workers, collate_fn=collate_views)
    terms = ("neg_elbo", "nce", "kl", "nce_mode")
    total, batches = dict.fromkeys(terms, 0.0), 0
    with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []):
        torch.manual_seed(cfg.seed)  # the same draws for every run of the command; the run's own RNG state restored
        for x in loader:
            h = learner.backbone(x.to(device)).float()
            # deterministic: computed once a batch, then summed with each draw's terms (the mean's arithmetic unchanged)
            nce_mode = learner.head.mode_nce(h)
            for _ in range(draws if learner.gated else 1):
                for k, v in dict(learner.head.objective_draw(h), nce_mode=nce_mode).items():
                    total[k] += v.item() / (draws if learner.gated else 1)
            batches += 1
    return {f"test_{k}": total[k] / batches for k in terms}


@torch.no_grad()
def view_pairs(learner, dataset, cfg: Config, channels: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """N x D backbone features of two augmented views of each image (the training augmentation, the run's seed)."""
    learner.eval()
    views = TwoViews(dataset, simclr_transform(cfg.image_size, channels), cfg.seed)
    loader = DataLoader(views, batch_size=max(cfg.batch_size, 256), num_workers=cfg.workers, collate_fn=collate_views)
    first, second = [], []
    for x in loader:
        h = learner.backbone(x.to(device)).float().cpu()
        first.append(h[:len(h) // 2])
        second.append(h[len(h) // 2:])
    return torch.cat(first), torch.cat(second)


def novelty_scorer(learner, data, cfg: Config, device, train_h: torch.Tensor | None = None,
                   train_y: torch.Tensor | None = None, controls: bool = True) -> novelty_scores.NoveltyScorer:
    """The run's ``novelty_scores.NoveltyScorer``, fitted on its training split.

    ``train_h``, ``train_y``: the split's backbone features and labels (extracted here when not given). With
    ``controls`` and gates, the control gating heads too, trained on the frozen backbone for as many steps as the run
    trained (``novelty_controls.fit_control_heads``).
    """
    if train_h is None:
        train_h, _, train_y = extract(learner, data.train, cfg, data.channels, device)
    fitted = None
    if controls and learner.gated:
        first, second = view_pairs(learner, data.train, cfg, data.channels, device)
        steps = cfg.epochs * max(1, len(data.train) // cfg.batch_size)
        steps = steps if cfg.max_steps is None else min(steps, cfg.max_steps)  # the run's own steps
        with torch.enable_grad():
            fitted = novelty_controls.fit_control_heads(learner, first, second, steps, cfg.batch_size, cfg.seed)
    return novelty_scores.NoveltyScorer(learner, train_h, train_y, data.num_classes, cfg.seed, fitted)


def novelty_evaluation(learner, data, cfg: Config, device, train_h: torch.Tensor, train_y: torch.Tensor,
                       test_h: torch.Tensor, progress: Progress | None = None) -> dict:
    """eval.json's ``novelty``: every novelty score of the run judged on each of ``data.novel``'s sets.

    The in-distribution images are the test split; the scores are those of :func:`novelty_scorer` (``train_h``,
    ``train_y``: the training split's backbone features and labels).
    """
    scorer = novelty_scorer(learner, data, cfg, device, train_h, train_y)
    novel = {name: scorer(extract(learner, images, cfg, data.channels, device, progress)[0])
             for name, images in data.novel().items()}
    return novelty_detection.report(scorer(test_h), novel, NOVEL_KINDS)


def evaluate(learner, data, cfg: Config, device, progress: Progress | None = None,
             test: TestFeatures | None = None) -> dict:
    """Evaluate a trained learner on the test split: probes, interpretability metrics, objective.

    Linear probe (top-1/5) and kNN top-1 on frozen backbone features h; the interpretability metrics and retrieval
    precision on the test split's representation F; on generated data whose test split records its factors, which factor
    each dimension tracks, F's DCI disentanglement and completeness against them (``dci.dci``) and, where the run's
    folder (``cfg.out``) holds its conflict.jsonl, the gradient conflict on the dims tracking each factor
    (``conflict_background``, ``conflict_class``: ``diagnostics.conflict_by_factor``); the training objective on the
    test split (:func:`test_objective`). Fractions in [0, 1]; ``protocol`` names how the linear probe and retrieval were
    done (``cfg.eval_protocol``).

    For BayesNCL the interpretability metrics are also reported for the same model's features before gating (keys ending
    in ``_ungated``): what the gates add, with the encoder held fixed; and at matched sparsity and as a posterior
    (``matched.py``): the ungated features under random masks as sparse as F (``_random_mask``), the posterior mean's
    soft gating (``_posterior_mean``) and draws from q (``_q_draws``); and beside controls as sparse as F image by image
    (``controls``, ``matched.count_matched_controls``, with the overlap of the gates' mask and post-hoc TopK's,
    ``controls.mask_jaccard``, and of random masks, ``controls.mask_jaccard_random``; ``control_definitions`` says what
    each is). ``representations`` says what each suffix is a figure of. Consistency is given twice: the paper's
    (``semantic_consistency``) and the top-N one that sparsity cannot game (``semantic_consistency_topn``, judged on
    ``topn_n`` samples a dim, with its coverage and ``topn_chance``, its value for a class-blind dim). Where the data
    has novel sets (``DataSpec.novel``: the generated data's), ``novelty``: each novelty score's detection figures per
    set (:func:`novelty_evaluation`). ``progress``
    (``progress.reporter``) shows the long parts go by: the features of each split, the linear probe's epochs. ``test``:
    the test split's :func:`test_features`, when the caller has them (else they are computed here).
    """
    h_tr, _, y_tr = extract(learner, data.train, cfg, data.channels, device, progress)
    test = test if test is not None else test_features(learner, data, device, progress)
    h_te, f_te, y_te = test.backbone, test.features, test.labels
    ungated, gates, probs = test.ungated, test.mask, test.probs
    recipe, num_dims = protocol(cfg.eval_protocol, cfg.dataset)
    probe = linear_probe(h_tr, y_tr, h_te, y_te, data.num_classes, recipe, seed=cfg.seed, progress=progress)
    results = dict(interpretability_metrics(f_te, y_te), topn_n=topn_size(len(y_te)), topn_chance=topn_chance(y_te))
    if learner.gated:
        results.update({keys.format(k, keys.UNGATED): v for k, v in interpretability_metrics(ungated, y_te).items()})
    results.update(linear_probe_top1=probe["top1"], linear_probe_top5=probe["top5"],
                   knn_top1=knn_top1(h_tr, y_tr, h_te, y_te))
    ks = tuple(k for k in (1, 3, 5, 10) if k < len(f_te))  # a tiny test split has fewer neighbours
    results.update({f"retrieval_p@{k}": p for k, p in retrieval_precision(f_te, y_te, ks, num_dims).items()})
    if learner.gated:
        results["gates_open"] = gates.float().mean().item()  # at the evaluation mask (F's), not the mean P(on)
    results.update(test_objective(learner, data.test, cfg, data.channels, device))
    factors = test.factors
    if factors is not None:
        results.update(factor_report(f_te, factors, ungated, gates))
        results.update(dci(f_te, factors, cfg.seed))
        conflict = conflict_table(cfg.out) if cfg.out else None  # the run's training records, where it wrote them
        if conflict is not None:
            results.update(conflict_by_factor(conflict, factor_tracking(f_te, factors)))
    if learner.gated:
        results.update(random_mask_null(ungated, f_te, y_te, factors, cfg.seed))
        results.update(posterior_representations(ungated, probs, y_te, factors, cfg.seed))
        results.update(controls=count_matched_controls(ungated, f_te, y_te, factors, cfg.seed),
                       control_definitions={**CONTROLS, **MASK_OVERLAP})
    if data.novel_sets is not None:
        results["novelty"] = novelty_evaluation(learner, data, cfg, device, h_tr, y_tr, h_te, progress)
    shown = [r for r in keys.REPRESENTATIONS if r == keys.F or learner.gated]
    return dict(method=cfg.method, dataset=cfg.dataset, protocol=cfg.eval_protocol, **results,
                representations={keys.suffix(r) or "(no suffix)": DEFINITIONS[r] for r in shown})


def factor_report(features, factors: dict, ungated=None, gates=None) -> dict:
    """How many dims track each ground-truth factor, before and after gating.

    F is the representation (N x K). For a gated learner (``ungated``: its N x K features before gating, ``gates``: its
    N x K 0/1 evaluation mask, the gates F uses), also how many dims of the ungated features track each factor and
    which share of those the gates switch off.

    A dim counts as switched off when its gate is closed in more than half of the samples where its
    ungated feature is active.
    """
    results = {f"dims_tracking_{name}": int(mask.sum()) for name, mask in factor_tracking(features, factors).items()}
    if ungated is not None:
        closed = closed_share(ungated, gates)
        for name, mask in factor_tracking(ungated, factors).items():
            switched_off = (closed[mask] > 0.5).double()
            results[keys.format(f"dims_tracking_{name}", keys.UNGATED)] = int(mask.sum())
            results[f"gated_off_dims_{name}"] = int(switched_off.sum())
            results[f"gated_off_share_{name}"] = float(switched_off.mean()) if mask.any() else 0.0
    return results


def by_representation(results: dict) -> dict[str, dict]:
    """An eval dict's figures by representation, in the order of ``keys.REPRESENTATIONS``, then by metric.

    Each key is read by ``keys.parse``; the blocks (``representations``, ``controls``, ...) and ``random_mask_keep``
    are left out, and so is a representation without figures (all but F for CL and NCL).
    """
    columns = {r: {} for r in keys.REPRESENTATIONS}
    for k, v in results.items():
        if isinstance(v, dict) or k == "random_mask_keep":  # representations, controls: in eval.json
            continue
        metric, representation = keys.parse(k)
        columns[representation][metric] = v
    return {r: figures for r, figures in columns.items() if figures}


COLUMN_NAMES = {keys.F: "gated", keys.UNGATED: "ungated", keys.POSTERIOR_MEAN: "q's mean", keys.Q_DRAWS: "q draws",
                keys.RANDOM_MASK: "random mask"}
"""The end-of-run table's column of each representation (``matched.DEFINITIONS`` says what each is)."""


def format_table(results: dict) -> str:
    """An eval dict as a text table: one row a metric, one column a representation.

    A gated run's other representations (every gate open, q's mean, draws of q, random masks as sparse as F:
    ``keys.REPRESENTATIONS``) each get a column beside the gated one, so that a metric is one row however many of them
    there are; ``random_mask_keep`` and the matched controls stay in eval.json.
    """
    columns = by_representation(results)
    shown = list(columns)
    cell = lambda v: "" if v is None else f"{v:.4f}" if isinstance(v, float) else printable(str(v))  # noqa: E731
    rows = [(printable(k), *(cell(columns[s].get(k)) for s in shown)) for k in columns[keys.F]]
    width = max(len(r[0]) for r in rows)
    if len(shown) > 1:
        rows.insert(0, ("", *(COLUMN_NAMES[s] for s in shown)))
    line = "-" * (width + 12 * len(shown))
    return "\n".join([line] + [f"{r[0]:<{width}}" + "".join(f"  {c:>10}" for c in r[1:]) for r in rows] + [line])