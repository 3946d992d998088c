"""Everything a run's per-dimension report shows, as numbers: report.json.

``build(run_dir, baseline)`` loads the run (and a baseline run on the same test split), computes its test features once
and gives (report.json's data, the test images as data URIs); ``report.py`` writes the page from them. The data: the
run's configuration and evaluation, its gate posterior in a few numbers (:func:`gate_summary`), its training curves,
a card per dimension in use (:func:`dimension_cards`), a row per test image (:func:`image_table`), the factor-tracking
table on generated data (:func:`factor_table`) and the baseline's dimensions. What each number is comes from
``bayesncl_pyro/evaluate/dimensions.py``, which ``experiments/inspect_gates.py`` draws from too.
"""

import base64
import contextlib
import io
import math
import os

import numpy as np
import torch
from PIL import Image

from bayesncl_pyro._version import __version__
from bayesncl_pyro.data import load_dataset
from bayesncl_pyro.data.compositional import BACKGROUNDS
from bayesncl_pyro.errors import UserError, quoted
from bayesncl_pyro.evaluate import dimensions as dm
from bayesncl_pyro.evaluate import keys
from bayesncl_pyro.evaluate.diagnostics import budget_note, trained_steps
from bayesncl_pyro.evaluate.heldout import COLUMN_NAMES, TestFeatures, by_representation, test_features
from bayesncl_pyro.evaluate.novelty_scores import binary_entropy
from bayesncl_pyro.evaluate.posterior import prior_rate
from bayesncl_pyro.infer.estimators import GateEstimator, gate_class
from bayesncl_pyro.nn.losses import bernoulli_kl
from bayesncl_pyro.rundir import EVAL, RunFolder, exists, read_eval, read_log, run_folder

TOP_IMAGES = 12  # per card, in F and with every gate open
CORRELATED = 5  # most correlated dimensions per card
NEIGHBOURS = 8  # per image, in each space
IMAGE_DIMS = 16  # dimensions listed on an image's page
ACTIVATION_BINS = 20
INCLUSION_BINS = 10
THUMBNAIL_PX = 64  # longest side of the images in the page; smaller images are kept at their size
FACTOR_VALUES = {"background": list(BACKGROUNDS)}  # value names of the generated data's factors besides the class


def _num(v):
    """A float for report.json: 4 significant digits, NaN and infinities as null."""
    v = float(v)
    return None if not math.isfinite(v) else float(f"{v:.4g}")


def _nums(t: torch.Tensor) -> list:
    """:func:`_num` of every entry of ``t``, as (nested) lists.

    Each is the nearest float to the rounded decimal (an integer over a power of ten), as ``_num`` gives it.
    """
    x = t.detach().double().cpu().numpy()
    finite = np.isfinite(x) & (x != 0)
    shift = np.where(finite, 3 - np.floor(np.log10(np.abs(np.where(finite, x, 1)))), 0)
    up = np.power(10.0, np.abs(shift))
    y = np.where(shift >= 0, np.round(x * up) / up, np.round(x / up) * up)
    y = np.where(np.isfinite(x), y, np.nan).astype(object)
    y[~np.isfinite(x)] = None
    return y.tolist()


def dimension_cards(feats: TestFeatures, kl: torch.Tensor | None = None, scores: dict | None = None) -> list[dict]:
    """One card per dimension in use (``dimensions.in_use``), in the order of the dimensions.

    ``scores``: ``dimensions.factor_scores(feats)`` where the caller has it, computed here otherwise. Image entries are
    ``[image, activation, q(g_k = 1 | x)]`` (the last only for a gated run), largest activation first; quantile
    entries ``[quantile, image, activation, q]``. :func:`report_data` adds ``baseline_closest``, ``[dim, r]``: the
    baseline's dimension that correlates most with this one.
    """
    f, n, c = feats.features, len(feats.labels), feats.num_classes
    dims = dm.in_use(f)
    if not len(dims):
        return []
    all_counts = dm.class_counts(f, feats.labels, c)
    share, dominant = dm.consistency(all_counts)
    consistency, dominant = _nums(share[dims]), dominant[dims].tolist()
    counts = all_counts[:, dims].T.tolist()
    active = dm.support(f)[dims]
    frequency, active = _nums(active / n), active.tolist()
    ranked = dm.Ranking(f)
    act_max = f.max(0).values
    act_hist = dm.histograms(f, ACTIVATION_BINS, act_max, where=f > dm.ACTIVE_EPS)[dims].tolist()
    near, r = dm.correlated_dims(f, dims, CORRELATED)
    near, r = near.tolist(), _nums(r)
    tracked = _tracked(feats, scores)
    factor_counts = {name: dm.class_counts(f, v, int(v.max()) + 1)[:, dims].T.tolist()
                     for name, v in (feats.factors or {}).items() if name != "class"}
    gated = feats.gated

    def entries(images: torch.Tensor, values: torch.Tensor) -> list[list]:
        """``images`` (len(dims) x T, -1 for none) as per-dimension lists of [image, value, q]."""
        rows = images.clamp_min(0)
        parts = [images.tolist(), _nums(values[rows, dims[:, None]])]
        if gated:
            parts.append(_nums(feats.probs[rows, dims[:, None]]))
        return [[list(e) for e in zip(*cols) if e[0] >= 0] for cols in zip(*parts)]

    top, quantiles = entries(ranked.top(dims, TOP_IMAGES), f), entries(ranked.at_quantiles(dims), f)
    columns = dict(mean_activation=f[:, dims].mean(0), max_activation=act_max[dims])
    if gated:
        probs = feats.probs[:, dims]
        top_u = entries(dm.Ranking(feats.ungated).top(dims, TOP_IMAGES), feats.ungated)
        incl = _nums(torch.stack(dm.inclusion_by_class(feats.probs, feats.labels, c), -1)[:, dims].transpose(0, 1))
        incl_hist = dm.histograms(feats.probs, INCLUSION_BINS)[dims].tolist()
        columns.update(mean_inclusion=probs.mean(0), inclusion_sd=probs.std(0))
        if kl is not None:
            columns["kl"] = kl[dims]
    columns = {name: _nums(v) for name, v in columns.items()}
    cards = []
    for row, k in enumerate(dims.tolist()):
        card = dict(dim=k, support=active[row], frequency=frequency[row], consistency=consistency[row],
                    dominant_class=dominant[row], tracked=tracked.get(k), top=top[row],
                    quantiles=[[q, *e] for q, e in zip(dm.QUANTILES, quantiles[row])],
                    class_counts=counts[row], activation_hist=act_hist[row],
                    correlated=[[j, v] for j, v in zip(near[row], r[row])],
                    **{name: v[row] for name, v in columns.items()})
        if factor_counts:
            card["factor_counts"] = {name: fc[row] for name, fc in factor_counts.items()}
        if gated:
            card.update(top_ungated=top_u[row], class_inclusion=incl[row],
                        inclusion_hist=incl_hist[row])
        cards.append(card)
    return cards


def _tracked(feats: TestFeatures, scores: dict | None) -> dict[int, str]:
    """The ground-truth factor each dimension of F tracks (generated data), by dimension."""
    if not feats.factors:
        return {}
    scores = dm.factor_scores(feats) if scores is None else scores
    return {k: name for name, s in scores.items() for k in s["tracks"].nonzero().flatten().tolist()}


def image_table(feats: TestFeatures, rate: torch.Tensor | None = None) -> dict:
    """Per test image: its class, the dimensions it uses, its nearest neighbours and how stable its mask is.

    Its class (and factors), its ``IMAGE_DIMS`` dimensions of largest activation in F as ``[dim, activation, q]`` with
    the number it uses, its nearest neighbours in F and with every gate open, and how stable its mask is under draws
    from q (``dimensions.mask_flip_share``); with the prior's ``rate`` (K, or N x K), its uncertainty: the posterior's
    novelty scores ``kl_prior`` and ``gate_entropy`` (``novelty_scores``) and each one's percentile in the test split.
    """
    f = feats.features
    values, dims = f.topk(min(IMAGE_DIMS, f.shape[1]), dim=1)
    out = dict(labels=feats.labels.tolist(), dims_on=dm.active_entries(f).sum(1).long().tolist(),
               neighbours=dm.neighbours(f, NEIGHBOURS).tolist())
    parts = [dims.tolist(), _nums(values)] + ([_nums(feats.probs.gather(1, dims))] if feats.gated else [])
    on = (values > dm.ACTIVE_EPS).tolist()
    out["top_dims"] = [[list(e) for e, keep in zip(zip(*cols), ons) if keep] for *cols, ons in zip(*parts, on)]
    if feats.factors:
        out["factors"] = {name: v.tolist() for name, v in feats.factors.items() if name != "class"}
    if feats.gated:
        out["neighbours_ungated"] = dm.neighbours(feats.ungated, NEIGHBOURS).tolist()
        out["mask_flip_share"] = _nums(dm.mask_flip_share(feats.probs, feats.mask))
        if rate is not None:
            p = feats.probs
            for name, v in (("kl_prior", bernoulli_kl(p, rate.expand_as(p), 0.0).sum(1)),
                            ("gate_entropy", binary_entropy(p).sum(1))):
                out[name] = _nums(v)
                out[name + "_percentile"] = _nums(v.argsort().argsort().double() / max(1, len(v) - 1))
    return out


def gate_summary(feats: TestFeatures, kl: torch.Tensor, kl_label: str, prior_rate: float) -> dict:
    """The gate posterior on the test split in a few numbers and histograms, with the warning when undecided.

    The warning (``dimensions.undecided_warning``) is given when the gates never left 0.5.
    """
    p, mask = feats.probs, feats.mask
    flips = dm.mask_flip_share(p, mask)
    flip_high = 0.5 if flips.max() <= 0.5 else 1.0  # above 0.5 only where the mask is not q's mode (gs-reference-kl)
    return dict(mean_inclusion=_num(p.mean()), inclusion_sd=_num(p.std()), gates_open=_num(mask.mean()),
                undecided_share=_num(dm.undecided_share(p)), undecided_within=dm.UNDECIDED,
                mostly_gated_dims=int(dm.mostly_gated(p).sum()), dims=p.shape[1], prior_rate=_num(prior_rate),
                mask_flip_share=_num(flips.mean()), kl_label=kl_label, kl_per_row=_num(kl.sum()),
                kl_sorted=_nums(kl.sort(descending=True).values), kl_dims=kl.argsort(descending=True).tolist(),
                inclusion_hist=dm.histograms(p.reshape(-1, 1), 20)[0].tolist(),
                dim_inclusion_hist=dm.histograms(p.mean(0, keepdim=True).T, 20)[0].tolist(),
                flip_hist=dm.histograms(flips[:, None], 20, flip_high)[0].tolist(), flip_hist_high=flip_high,
                warning=dm.undecided_warning(p))


def factor_table(feats: TestFeatures, scores: dict) -> dict:
    """Generated data: per dimension in use, how much each factor explains it, with the gates and without.

    For each dimension in use in F or with every gate open: how much each factor explains its on/off pattern with the
    gates and without (``scores``: ``dimensions.factor_scores(feats)``), which factor it tracks in each, and the share
    of its active entries the gates close; plus each factor's value names.
    """
    used = dm.alive(feats.features)
    if feats.gated:
        used |= dm.alive(feats.ungated)
    closed = dm.gates_closed(feats) if feats.gated else None
    rows = []
    for k in used.nonzero().flatten().tolist():
        row = dict(dim=k)
        for r in (keys.F, keys.UNGATED) if feats.gated else (keys.F,):
            information, tracks = keys.format("information", r), keys.format("tracks", r)
            row.update({f"{name}_{information}": _num(s[information][k]) for name, s in scores.items()})
            row[tracks] = next((n for n, s in scores.items() if s[tracks][k]), None)
        if feats.gated:
            row["gates_closed"] = _num(closed[k])
        rows.append(row)
    values = {name: feats.classes if name == "class" else FACTOR_VALUES.get(name) or [
        str(v) for v in range(int(feats.factors[name].max()) + 1)] for name in scores}
    return dict(names=list(scores), values=values, rows=rows)


def training_curves(log: list[dict], gate: str | None, kl_weight: float) -> dict:
    """The training log's loss terms over the steps, labelled by the log's own fields.

    With ``objective``: what the run's gate estimator (``gate``; None without gates) minimised, in words
    (``GateEstimator.objective``: -ELBO, or the reference's surrogate); and how well the log's ``loss`` is its ``nce``
    + lambda * ``kl``, as the largest relative difference over the records.
    """
    try:  # the log's records as a run writes them: numbers, a list of warnings
        keys = [k for k in ("loss", "nce", "kl", "gate_rate", "incl_min", "incl_max") if log and k in log[0]]
        out = dict(step=[r["step"] for r in log], series={k: [_num(r.get(k, math.nan)) for r in log] for k in keys},
                   objective=gate_class(gate).objective if gate else "InfoNCE per row (no latent variables)")
        if gate and log:
            # a run with --gate-density logs each step's lambda
            gap = max(abs(r["loss"] - r["nce"] - r.get("kl_weight", kl_weight) * r["kl"]) / max(abs(r["loss"]), 1e-12)
                      for r in log)
            out["loss_is_nce_plus_weighted_kl"] = _num(gap)
        # what the log says in words, if any
        notes = {k: v for r in log[-1:] for k, v in r.items() if isinstance(v, str)}
        if notes:
            out["notes"] = notes
        out["warnings"] = [[r["step"], w] for r in log if "warnings" in r for w in r["warnings"]][:20]
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"the run's log.jsonl holds records that are not what a run writes ({type(e).__name__}: "
                        f"{quoted(str(e))[1:-1]}); move it away") from None
    return out


def _run_info(run) -> dict:
    cfg = run.cfg
    return dict(dir=str(run.dir), method=cfg.method, dataset=cfg.dataset, config=cfg.to_dict(),
                steps=trained_steps(run.dir))


def report_data(feats: TestFeatures, run: dict, log: list[dict] | None = None, evaluation: dict | None = None,
                gates: dict | None = None, kl: torch.Tensor | None = None, baseline: dict | None = None,
                rate: torch.Tensor | None = None) -> dict:
    """Everything the page shows (report.json).

    ``run``: the run's ``dir``, ``method``, ``dataset`` and ``config``; ``gates``: :func:`gate_summary`'s, ``kl``:
    :func:`dimensions.kl_per_dim`'s, ``rate``: the prior's inclusion rate (K or N x K: each image's uncertainty,
    :func:`image_table`) (gated runs); ``baseline``: another run's ``run`` dict with its ``features`` (a TestFeatures of
    the same test split) and ``evaluation``.
    """
    n, k = feats.features.shape
    scores = dm.factor_scores(feats) if feats.factors else None
    cards = dimension_cards(feats, kl, scores)
    columns = None if evaluation is None else [[COLUMN_NAMES[r], figures]
                                               for r, figures in by_representation(evaluation).items()]
    out = dict(version=__version__, run=run, evaluation=evaluation, evaluation_columns=columns, gates=gates,
               classes=feats.classes,
               sizes=dict(images=n, dims=k, dims_in_use=len(cards), dims_not_in_use=k - len(cards),
                          classes=feats.num_classes, min_support=dm.min_support(n, feats.num_classes),
                          top_images=TOP_IMAGES, thumbnail_px=THUMBNAIL_PX),
               quantiles=list(dm.QUANTILES), training=training_curves(log or [], run["config"]["gate"] if feats.gated
                                                                      else None, run["config"].get("kl_weight", 0.0)),
               dims=cards, images=image_table(feats, rate),
               factors=factor_table(feats, scores) if feats.factors else None)
    if baseline is not None:
        base = baseline["features"]
        base_cards = dimension_cards(base)
        if cards and base_cards:
            near, r = dm.closest_dims(feats.features, dm.in_use(feats.features), base.features,
                                      dm.in_use(base.features))
            for card, j, v in zip(cards, near.tolist(), _nums(r)):
                card["baseline_closest"] = [j, v]
        out["baseline"] = dict(run=baseline["run"], evaluation=baseline.get("evaluation"), dims=base_cards,
                               dims_not_in_use=base.features.shape[1] - len(base_cards),
                               neighbours=dm.neighbours(base.features, NEIGHBOURS).tolist(),
                               note=budget_note(run["method"], run.get("steps"), baseline["run"]["method"],
                                                baseline["run"].get("steps")))
    return out


def thumbnails(dataset, size: int = THUMBNAIL_PX) -> list[str]:
    """Every image of ``dataset`` as a data URI, its longest side at most ``size`` px.

    PNG for grey and tiny images, JPEG (quality 85) for the rest.
    """
    out = []
    for i in range(len(dataset)):
        image = dataset[i][0]
        if torch.is_tensor(image):
            array = image.permute(1, 2, 0).numpy()
            image = Image.fromarray(array[..., 0] if array.shape[2] == 1 else array)
        if max(image.size) > size:
            image = image.copy()
            image.thumbnail((size, size), Image.Resampling.BILINEAR)
        buf = io.BytesIO()
        png = image.mode == "L" or max(image.size) <= 16
        image.save(buf, "PNG" if png else "JPEG", **({} if png else dict(quality=85)))
        out.append(f"data:image/{'png' if png else 'jpeg'};base64," + base64.b64encode(buf.getvalue()).decode())
    return out


def build(run_dir: str | os.PathLike, baseline: str | os.PathLike | None = None, device: str = "cpu", *,
          trust_code: bool = False, data_dir: str | os.PathLike | None = None) -> tuple[dict, list[str]]:
    """(report.json's data, the test images as data URIs) of a trained run, beside a baseline run.

    ``trust_code``, ``data_dir``: as ``load_run`` takes them, for both. Each run folder is opened once
    (``rundir.RunFolder``): its checkpoint, log and evaluation are read from the same folder.
    """
    with RunFolder.open(run_folder(run_dir)), \
            RunFolder.open(run_folder(baseline)) if baseline is not None else contextlib.nullcontext():
        return _build(run_dir, baseline, device, trust_code=trust_code, data_dir=data_dir)


def _build(run_dir: str | os.PathLike, baseline: str | os.PathLike | None, device: str, *, trust_code: bool,
           data_dir: str | os.PathLike | None) -> tuple[dict, list[str]]:
    """:func:`build`, with the run folders open."""
    from bayesncl_pyro.evaluate.run import load_run  # late: run imports the training stack

    run = load_run(run_dir, device, trust_code=trust_code, data_dir=data_dir)
    cfg, learner = run.cfg, run.learner
    other = load_run(baseline, device, trust_code=trust_code, data_dir=data_dir) if baseline is not None else None
    # what the run folders hold besides the checkpoint, read first: a file refused there costs no computation
    log, evaluation = read_log(run.dir), _evaluation(run)
    base_evaluation = _evaluation(other) if other is not None else None
    if other is not None and other.cfg.dataset != cfg.dataset:
        raise UserError(f"the baseline {baseline} was trained on {other.cfg.dataset}, {run_dir} on {cfg.dataset}: "
                        "the report puts both on one test split; pass a baseline trained on the same --dataset")
    data = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed, holdout=cfg.holdout_cells)
    feats = test_features(learner, data)
    gates = kl = rate = None
    if learner.gated:
        rate = prior_rate(learner, feats)
        kl = dm.kl_per_dim(feats.probs, rate, cfg.kl_clamp)
        gates = gate_summary(feats, kl, GateEstimator.kl_label(cfg.kl_clamp), float(rate.mean()))
    base = None
    if other is not None:
        same = (other.cfg.dataset, other.cfg.data_dir, other.cfg.seed, other.cfg.holdout_cells) == (
            cfg.dataset, cfg.data_dir, cfg.seed, cfg.holdout_cells)
        other_data = data if same else load_dataset(other.cfg.dataset, other.cfg.data_dir, seed=other.cfg.seed,
                                                    holdout=other.cfg.holdout_cells)
        base_feats = test_features(other.learner, other_data)
        if not torch.equal(base_feats.labels, feats.labels):
            raise UserError(f"the baseline {baseline} was evaluated on another test split ({other.cfg.dataset}, seed "
                            f"{other.cfg.seed}) than {run_dir} ({cfg.dataset}, seed {cfg.seed}); train the baseline "
                            "with the same --dataset, --data-dir and --seed")
        base = dict(run=_run_info(other), features=base_feats, evaluation=base_evaluation)
    out = report_data(feats, _run_info(run), log, evaluation, gates, kl, base, rate)
    return out, thumbnails(data.test)


def _evaluation(run) -> dict | None:
    return read_eval(run.dir, run.cfg.gate) if exists(run.dir / EVAL) else None
