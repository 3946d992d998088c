"""What a few seeds' paired differences allow one to say: intervals, bounds, equivalence, power, a family's p values.

For d_1..d_n, one difference a seed (a method minus a baseline on the same seed), with mean m, sample standard deviation
s and standard error se = s / sqrt(n), Student's t with n - 1 degrees of freedom gives

* the two-sided 95 % interval m -/+ t_0.975 se, and the p value of a zero mean;
* the one-sided 95 % bounds m - t_0.95 se and m + t_0.95 se: "no gain above the upper bound" and "no loss below the
  lower bound", each at 95 % confidence on its own;
* equivalence by two one-sided tests (TOST) within -/+ a margin the caller gives (a comparison's is declared in
  ``design``, relative to the baseline): its p is the larger of the two one-sided p values; below 0.05 the difference
  lies within the margin at 95 % (the 90 % interval inside it);
* the minimum detectable difference (:func:`minimum_detectable`): the true mean difference that a two-sided 5 % paired
  t test of n seeds detects with 80 % power, taking the seeds' s as the true standard deviation;

and over the family of comparisons of one table, Holm's step-down adjustment of their p values (:func:`holm`).
"""

import math

import torch

POWER = 0.8
"""The power at which :func:`minimum_detectable` is given."""

ALPHA = 0.05
"""The two-sided level of every test here (and one minus the intervals' level)."""

BOOTSTRAP = 10_000
"""Resamples of the seeds' differences behind the bootstrap interval."""


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1 in the denominator; 0 for one value) of a non-empty list."""
    m = sum(values) / len(values)
    return m, math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0


def minimum_detectable(sd: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The smallest true mean difference a two-sided paired t test of ``n`` seeds detects with probability ``power``.

    At level ``alpha``, with the differences' standard deviation ``sd``: the delta at which the noncentral t with
    n - 1 degrees of freedom and noncentrality delta sqrt(n) / sd falls outside -/+ t_(1 - alpha / 2) with probability
    ``power``. 0 where ``sd`` is 0; NaN below two seeds.
    """
    from scipy import optimize, stats  # late: scipy's import costs a second, and only the comparison's tables need it

    if n < 2:
        return math.nan
    if sd == 0:
        return 0.0
    df, crit = n - 1, float(stats.t.ppf(1 - alpha / 2, n - 1))

    def shortfall(effect):  # power at a standardised effect (delta / sd) less the power asked for
        nc = effect * math.sqrt(n)
        # the far tail by symmetry, cdf(-c; nc) = sf(c; -nc): scipy's cdf turns NaN where it is below 1e-300
        return stats.nct.sf(crit, df, nc) + stats.nct.sf(crit, df, -nc) - power

    return float(optimize.brentq(shortfall, 1e-9, 1e3)) * sd


def interval(differences: list[float], level: float = 1 - ALPHA, seed: int = 0, margin: float | None = None) -> dict:
    """Mean of paired differences with its intervals, bounds, equivalence test and power.

    ``differences``: one per seed. The sign count (``above``, ``below``) and, from two seeds: the ``level`` interval
    two ways, Student's t (``t_low``, ``t_high``, with ``p``, the two-sided p of a zero mean) and the percentile
    bootstrap over seeds (``boot_low``, ``boot_high``: :data:`BOOTSTRAP` seeded resamples); the one-sided ``level``
    bounds ``bound_low`` and ``bound_high``; given a ``margin``, the TOST p within -/+ it (``tost_p``, with
    ``margin``); and the minimum detectable difference at :data:`POWER` (``mdd``, :func:`minimum_detectable` at the
    seeds' sd).
    """
    from scipy import stats  # late: as in minimum_detectable

    d = torch.tensor(differences, dtype=torch.float64)
    n, mean = len(d), float(d.mean())
    out = dict(n=n, mean=mean, above=int((d > 0).sum()), below=int((d < 0).sum()))
    if n < 2:
        return out
    sd = float(d.std())
    se = sd / math.sqrt(n)
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * se
    one_sided = float(stats.t.ppf(level, n - 1)) * se
    if se > 0:
        p = float(2 * stats.t.sf(abs(mean) / se, n - 1))
        # H0: mean <= -margin (rejected by a large t) and H0: mean >= margin (rejected by a small t)
        tost = None if margin is None else max(float(stats.t.sf((mean + margin) / se, n - 1)),
                                               float(stats.t.cdf((mean - margin) / se, n - 1)))
    else:  # every seed the same difference: known exactly
        p = 0.0 if mean else 1.0
        tost = None if margin is None else 0.0 if abs(mean) < margin else 1.0
    g = torch.Generator().manual_seed(seed)
    means = d[torch.randint(n, (BOOTSTRAP, n), generator=g)].mean(dim=1)
    low, high = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    equivalence = {} if margin is None else dict(tost_p=tost, margin=margin)
    return dict(out, sd=sd, t_low=mean - half, t_high=mean + half, p=p, boot_low=float(low), boot_high=float(high),
                bound_low=mean - one_sided, bound_high=mean + one_sided, **equivalence,
                mdd=minimum_detectable(sd, n, 1 - level))


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p values of a family, in the order given.

    The i-th smallest p is multiplied by (m - i + 1), m the family's size, made no smaller than the adjusted value
    before it, and capped at 1: rejecting where the adjusted p is below alpha keeps the chance of any false rejection in
    the family at most alpha.
    """
    m = len(p_values)
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda j: p_values[j])):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted
