"""Training diagnostics: the optimization conflict of InfoNCE per dimension, and gate degeneracy.

The optimisation conflict (docs/METHOD.md): on a dimension that many items share, the positive pairs pull the
feature up while the negatives push it down; the two parts of the gradient cancel on average, and the
total oscillates in sign from step to step. For the summed loss ``sum_i l_i`` over R rows ``u``
(rows i and p(i) are the two views of one image, P the softmax of the similarities over the other
rows, self excluded), the gradient on row k splits exactly into

    pos_k = -2 u_p(k) / tau                      (the numerators: pull towards the other view)
    neg_k = sum_j (P_kj + P_jk) u_j / tau        (the partition functions: push from every other row)

A dimension is measured on the entries where it takes part in the loss (|u_ik| > 0: feature on and,
for BayesNCL, gate open), so a gated-off entry never counts: over *all* rows the two parts of any
dimension nearly cancel (the softmax columns sum to about one), which says nothing about conflict.
``conflict_record`` summarises one batch (per dimension: the mean of each part over its active
entries, and its activation frequency); ``conflict_scores`` turns a series of records into scores,
``conflict_table`` a run's conflict.jsonl, and ``conflict_lines`` says what a table shows in a few lines.
"""

import json
import math
import os
import warnings
from pathlib import Path

import numpy as np
import torch

from bayesncl_pyro.errors import UserError
from bayesncl_pyro.nn.losses import ACTIVE_EPS, partner_rows
from bayesncl_pyro.rundir import CONFLICT, read_log, read_records


def nce_grad_parts(u: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The InfoNCE gradient w.r.t. the rows, split into its positive-pair and negative-pair parts.

    Returns (pos, neg), R x K each, of the gradient of ``info_nce_rows(u, tau).sum()`` w.r.t. u (R x K rows in the
    layout ``[view 1; view 2]``); pos + neg is the whole gradient.
    """
    rows = u.shape[0]
    logits = (u @ u.T / temperature).fill_diagonal_(float("-inf"))
    p = logits.softmax(dim=1)
    return -2 * u[partner_rows(rows, u.device)] / temperature, (p + p.T) @ u / temperature


def conflict_record(u: torch.Tensor, temperature: float) -> dict[str, torch.Tensor]:
    """One batch's per-dimension gradient-conflict summary.

    K each: ``pos`` and ``neg``, the means of the two gradient parts over the entries where the dimension is active (NaN
    if it is active in no row), and ``freq``, the share of rows in which it is active. u: R x K, the (gated) rows the
    loss sees.
    """
    pos, neg = nce_grad_parts(u.detach().float(), temperature)
    active = (u.abs() > ACTIVE_EPS).to(pos)
    count = active.sum(0)
    mean = lambda part: (part * active).sum(0) / count  # noqa: E731 - 0/0 = NaN marks an unused dim
    return dict(pos=mean(pos), neg=mean(neg), freq=count / u.shape[0])


def conflict_scores(pos: np.ndarray, neg: np.ndarray) -> dict[str, np.ndarray]:
    """Per-dimension scores over T records of K dims (``pos``, ``neg``: T x K, NaN where unused).

    Returns K arrays: mean and variance over records of each part and of their sum ``total``;
    ``cancellation`` = 1 - |mean total| / (|mean pos| + |mean neg|), 1 when the pull of the positives and
    the push of the negatives cancel exactly (the conflict), 0 when one of them acts alone;
    ``oscillation`` = var(total) / mean(total)^2, large when what is left after cancelling is noise;
    ``sign_flips`` = share of consecutive measured records whose total changes sign (about 0.5 for
    noise, 0 for a steady pull or push). NaN for a dimension never measured (flips: fewer than twice).
    """
    total = pos + neg
    out = {}
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: dims never active
        for name, x in (("pos", pos), ("neg", neg), ("total", total)):
            out[f"{name}_mean"], out[f"{name}_var"] = np.nanmean(x, 0), np.nanvar(x, 0)
        out["cancellation"] = 1 - np.abs(out["total_mean"]) / (np.abs(out["pos_mean"]) + np.abs(out["neg_mean"]))
        out["oscillation"] = out["total_var"] / out["total_mean"] ** 2
    flips = np.full(total.shape[1], np.nan)
    for k in range(total.shape[1]):
        signs = np.sign(total[~np.isnan(total[:, k]), k])
        if len(signs) >= 2:
            flips[k] = np.mean(signs[1:] != signs[:-1])
    out["sign_flips"] = flips
    return out


def to_json(rec: dict) -> str:
    """A conflict record as one JSON line: 4 significant digits, NaN as null."""
    def num(v):
        return None if math.isnan(v) else float(f"{v:.4g}")

    return json.dumps({k: [num(v) for v in x.tolist()] if torch.is_tensor(x) else x for k, x in rec.items()})


def read_conflict(run_dir: str | os.PathLike) -> dict[str, np.ndarray] | None:
    """A run's ``conflict.jsonl`` as arrays, or None if it has none.

    ``step`` (T) and ``pos``, ``neg``, ``freq``, and ``incl`` for gated runs (T x K, NaN for null); None if the run has
    none.
    """
    path = Path(run_dir) / CONFLICT
    recs = read_records(path)
    if not recs:
        return None
    try:
        return {k: np.array([r[k] for r in recs], dtype=float) for k in recs[0]}
    except (KeyError, TypeError, ValueError):  # records of other keys or shapes: not what a run writes
        raise UserError(f"{path} holds records that are not conflict records of one run (their keys or lengths "
                        "differ); move it away") from None


def conflict_table(run_dir: str | os.PathLike) -> dict | None:
    """Per-dimension conflict scores of a run over its logged steps.

    With each dimension's mean activation frequency and, for BayesNCL, mean inclusion over the logged steps; None if the
    run logged no conflict records.
    """
    recs = read_conflict(run_dir)
    if recs is None or len(recs["step"]) < 2:
        return None
    out = conflict_scores(recs["pos"], recs["neg"])
    out["freq"] = recs["freq"].mean(0)
    if "incl" in recs:
        out["incl"] = recs["incl"].mean(0)
    return out


def conflict_by_factor(table: dict, tracking: dict) -> dict:
    """A run's conflict on the dims that track each ground-truth factor: eval.json's ``conflict_<name>``.

    ``table``: :func:`conflict_table`; ``tracking``: ``{name: K bool mask}`` of the dims tracking each factor
    (``metrics.factor_tracking`` of the evaluated representation, the rule ``dimensions.factor_scores`` applies).
    ``conflict_<name>``: the mean ``cancellation`` over those dims that were measured in training (left out where none
    was), with ``conflict_dims_<name>``, how many were.
    """
    out = {}
    for name, mask in tracking.items():
        values = table["cancellation"][np.asarray(mask, dtype=bool)]
        values = values[np.isfinite(values)]
        out[f"conflict_dims_{name}"] = len(values)
        if len(values):
            out[f"conflict_{name}"] = float(values.mean())
    return out


def trained_steps(run_dir: str | os.PathLike) -> int | None:
    """The last step a run's log.jsonl records, its length so far; None for a run without one."""
    log = read_log(run_dir)
    return int(log[-1]["step"]) if log else None


def budget_note(name: str, steps: int | None, base_name: str, base_steps: int | None) -> str | None:
    """A line saying that a run and its baseline trained for different numbers of steps; None when they did not.

    ``name``, ``base_name``: what the two runs are (their methods); ``steps``, ``base_steps``: :func:`trained_steps`'s.
    """
    if steps is None or base_steps is None or steps == base_steps:
        return None
    return (f"note: the baseline ({base_name}) trained {base_steps} steps and this run ({name}) {steps}: they are "
            "compared at different budgets; train the baseline for as many steps (run_svi.py prints its command under "
            "next:)")


def _median(x, mask=None) -> float:
    x = x if mask is None else x[mask]
    x = x[np.isfinite(x)]
    return float(np.median(x)) if len(x) else float("nan")


def conflict_lines(name: str, t: dict, gated_off: np.ndarray | None = None) -> list[str]:
    """A conflict table in a few lines of text.

    Of the ``name`` run (``conflict_table``): medians over dimensions, the rank correlation of activation frequency and
    cancellation, and with ``gated_off`` (K bool, the dimensions mostly gated on the test split:
    ``dimensions.mostly_gated``) the medians of the dimensions mostly open and mostly gated.
    """
    freq = t["freq"]
    lines = [f"conflict ({name}), medians over dimensions: cancellation {_median(t['cancellation']):.3f}, "
             f"oscillation {_median(t['oscillation']):.3g}, sign flips {_median(t['sign_flips']):.2f}"]
    ok = np.isfinite(t["cancellation"]) & np.isfinite(freq)
    if ok.sum() > 2:
        rank = lambda x: np.argsort(np.argsort(x))  # noqa: E731
        rho = np.corrcoef(rank(freq[ok]), rank(t["cancellation"][ok]))[0, 1]
        lines.append(f"  Spearman(activation frequency, cancellation) = {rho:.2f}")
    if gated_off is not None:
        for label, mask in (("mostly open on the test split", ~gated_off), ("mostly gated on the test split",
                                                                            gated_off)):
            lines.append(f"  {label}: {int(mask.sum())} dims, cancellation {_median(t['cancellation'], mask):.3f}, "
                         f"oscillation {_median(t['oscillation'], mask):.3g}, activation {_median(freq, mask):.3f}")
    return lines


def degeneracy_warnings(rec: dict, num_features: int) -> list[str]:
    """Warnings for a training-log record of a degenerate run.

    No feature left to contrast (every row is zero); for gated runs (nearly) all gates closed or all open, or a KL so
    small that q(g | x) is the prior for every item (the gates then carry no information about the image).
    """
    out = []
    if rec["active"] == 0:
        out.append("every feature of every row is zero: InfoNCE is stuck at log(rows - 1) and no gradient flows")
    if "gate_rate" not in rec:
        return out
    if rec["gate_rate"] < 0.05:
        out.append(f"nearly all gates are closed (mean inclusion {rec['gate_rate']:.3f})")
    elif rec["gate_rate"] > 0.95:
        out.append(f"nearly all gates are open (mean inclusion {rec['gate_rate']:.3f})")
    if rec["kl"] / num_features < 1e-3:
        out.append(f"KL collapse: the gate posterior is at the prior, as far as the trained KL tells "
                   f"(KL {rec['kl']:.2g} nats per row)")
    return out
