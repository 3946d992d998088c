"""Each latent site's KL(q || p) term of the ELBO, and how it is estimated: one home for the four ways.

The gate site's q is a product of Bernoullis over a row's K gates (``guides/gates.py``); its KL is taken at the
estimator's inclusion probabilities pi (``GateEstimator.kl_probs``: q's own, sigmoid(l) for ``gs-reference-kl``),
each clamped to [c, 1 - c] by the estimator's ``kl_clamp`` c (0: none). Whatever the gates' value in training (for
``ste`` the mode of q, which is no draw of it), the KL's value and gradient come from here:

``analytic``
    a KL registered in ``torch.distributions.kl`` for (q, p); for a prior of Bernoulli gates, the Bernoulli KL with
    both rates clamped (``nn.losses.bernoulli_kl``, the reference's).
``exact, enumerated per gate``
    p factorises over the gates as q does (an ``Independent`` whose base has q's batch shape: Bernoulli gates written
    as ``Binomial(1, rho)``, say) but no KL is registered: each gate's KL summed over its two values, exact. Where p's
    law per gate is a Bernoulli (p(0) + p(1) = 1) this is the analytic one, clamped the same.
``Monte Carlo, local expectation per gate``
    p couples a row's gates (correlated gates, a mixture that sums out a discrete latent): KL = -H(q) - E_q[log p(g)].
    q's entropy is exact; E_q[log p(g)] is taken at a real draw b ~ Bernoulli(pi), and its gradient in pi is, per
    gate, the exact difference log p(b with b_k = 1) - log p(b with b_k = 0) at the other gates' draw (local
    expectation gradients, Titsias and Lazaro-Gredilla 2015, as ``leg`` takes InfoNCE's): unbiased, since q
    factorises over the gates, with no score-function variance. p's own parameters get the pathwise gradient of
    log p(b). It costs K + 1 evaluations of p's log-density per row, but for a mixture of Bernoulli products, whose K
    flips come from its components in one pass, and for a law that gives them itself: a method
    ``flip_log_probs(b)`` returning log p(b with gate k flipped) for every k, K x rows, which the law's structure
    can make cheaper than K log-densities (an autoregressive law's flips change only the later gates' logits, by
    one column of its weights: ``experiments/bench_coupled_kl.py``).
``Monte Carlo, one pathwise draw``
    a prior's continuous latent with no registered KL: log q(z) - log p(z) at the guide's reparameterised draw
    (``TraceMeanField_ELBO``'s own estimate), unbiased in value and gradient. So too an autoguide's site (a ``Delta``
    at the transformed draw, its log-density the transform's Jacobian, plus the guide-only draw it transforms, whose
    log-density the ELBO adds): Pyro registers KL(Delta || p) as -log p(v), which drops the Jacobian, and
    ``TraceMeanField_ELBO`` with an autoguide of a constrained latent takes it so. A discrete latent has no such
    estimate here and is refused when the head is built (``models.priors.checked_guide``).
"""

import torch
from pyro.distributions import Delta
from torch.distributions import Bernoulli, Distribution, Independent, MixtureSameFamily, kl_divergence

from bayesncl_pyro.errors import UserError
from bayesncl_pyro.nn.losses import bernoulli_kl

ANALYTIC = "analytic"
ENUMERATED = "exact, enumerated per gate"
LOCAL_EXPECTATION = "Monte Carlo, local expectation per gate"
PATHWISE = "Monte Carlo, one pathwise draw"

_FLIP_CHUNK = 1 << 24  # entries of the flipped gates evaluated at once: 64 MiB of float32


def gates_of(q: Distribution) -> tuple[Bernoulli | None, int]:
    """(q's Bernoulli, its event dimensions) for a gate site: a Bernoulli, bare or in one ``Independent``."""
    dims = q.reinterpreted_batch_ndims if isinstance(q, Independent) else 0
    base = q.base_dist if dims else q
    return (base, dims) if isinstance(base, Bernoulli) else (None, 0)


def _factor_of(p: Distribution, gates: Bernoulli, dims: int) -> Distribution | None:
    """P's law of one gate where p factorises over the gates as q does, else None."""
    if dims and isinstance(p, Independent) and p.reinterpreted_batch_ndims == dims \
            and p.base_dist.batch_shape == gates.batch_shape:
        return p.base_dist
    if not dims and p.batch_shape == gates.batch_shape and not p.event_shape:
        return p
    return None


def _sum_events(kl: torch.Tensor, dims: int) -> torch.Tensor:
    """Sum the last ``dims`` dimensions, as torch's KL of two ``Independent`` sums its base KL."""
    return kl.reshape(kl.shape[:-dims] + (-1,)).sum(-1) if dims else kl


def site_kl(q: Distribution, p: Distribution, value: torch.Tensor, kl_probs=None,
            kl_clamp: float | None = None) -> tuple[torch.Tensor, str]:
    """(KL(q || p) term, how it was estimated) of one latent site, summed over its event dimensions.

    ``value``: the guide's value at the site (the pathwise draw of a continuous latent); ``kl_probs``: for a gate site,
    q's Bernoulli -> the probabilities the KL is taken at (default its ``probs``); ``kl_clamp``: None, no clamp; c, the
    gates' rates clamped to [c, 1 - c]. The four ways: the module docstring.
    """
    gates, dims = gates_of(q)
    if gates is not None:
        probs = gates.probs if kl_probs is None else kl_probs(gates)
        p_gates, p_dims = gates_of(p)
        if kl_clamp is not None and p_gates is not None and p_dims == dims:
            return _sum_events(bernoulli_kl(probs, p_gates.probs, kl_clamp), dims), ANALYTIC
    if isinstance(q, Delta):  # an autoguide's value: Pyro's KL(Delta || p) = -log p(v) drops its log-density
        return q.log_prob(value) - p.log_prob(value), PATHWISE
    try:
        return kl_divergence(q, p), ANALYTIC
    except NotImplementedError:
        pass
    if gates is None:
        return q.log_prob(value) - p.log_prob(value), PATHWISE
    lo = max(kl_clamp or 0.0, torch.finfo(probs.dtype).eps)
    probs = probs.clamp(lo, 1 - lo)
    factor = _factor_of(p, gates, dims)
    if factor is not None:
        return _sum_events(_enumerated(probs, factor, kl_clamp), dims), ENUMERATED
    return _local_expectation(probs, p, dims), LOCAL_EXPECTATION


def _enumerated(probs: torch.Tensor, factor: Distribution, kl_clamp: float | None) -> torch.Tensor:
    """Each gate's KL(Bernoulli(probs) || factor), summed over its two values."""
    on, off = (factor.log_prob(torch.full_like(probs, v)) for v in (1.0, 0.0))
    # per gate, without a host sync (torch.allclose would read the device at every step): where the factor is a
    # Bernoulli in law, the analytic KL with the clamp
    bernoulli = torch.isclose(on.exp() + off.exp(), torch.ones_like(on), atol=1e-5)
    return torch.where(bernoulli, bernoulli_kl(probs, on.exp(), kl_clamp or 0.0),
                       probs * (probs.log() - on) + (1 - probs) * ((1 - probs).log() - off))


def _local_expectation(probs: torch.Tensor, p: Distribution, dims: int) -> torch.Tensor:
    """-H(q) - log p(b) at a draw b ~ Bernoulli(probs), with the local expectation gradient per gate.

    Its value is an unbiased estimate of KL(q || p); its gradient in ``probs`` is, per gate, -E[log p(g_k = 1, b_-k)
    - log p(g_k = 0, b_-k)] plus the entropy's, and in p's parameters the pathwise gradient of -log p(b).
    """
    if dims != 1:
        raise NotImplementedError("the local expectation KL takes gates with one event dimension (a row's K gates)")
    b = torch.bernoulli(probs.detach())
    log_p = p.log_prob(b)  # rows
    flips = _flipped_log_probs(p, b)  # K x rows: log p(b with gate k flipped)
    diff = ((flips - log_p.detach()).movedim(0, -1) * (1 - 2 * b)).detach()  # log p(b_k = 1) - log p(b_k = 0)
    neg_entropy = (torch.xlogy(probs, probs) + torch.xlogy(1 - probs, 1 - probs)).sum(-1)
    return neg_entropy - log_p - ((probs - probs.detach()) * diff).sum(-1)


@torch.no_grad()
def _flipped_log_probs(p: Distribution, b: torch.Tensor) -> torch.Tensor:
    """Log p at b with each gate flipped in turn, K x rows.

    A law with a ``flip_log_probs(b)`` method gives them itself; a mixture of Bernoulli products (``MixtureSameFamily``
    of an ``Independent`` Bernoulli: a mixture of sparsity regimes) gives all K at once from its components
    (:func:`_mixture_flips`); any other law through its ``log_prob`` on the flipped copies, in chunks of gates that
    bound the memory.
    """
    if callable(own := getattr(p, "flip_log_probs", None)):
        flips = own(b)
        want = (b.shape[-1], *b.shape[:-1])
        if not torch.is_tensor(flips) or flips.shape != want:
            got = tuple(flips.shape) if torch.is_tensor(flips) else type(flips).__name__
            raise UserError(f"{type(p).__name__}.flip_log_probs(b) gave {got}; it must give log p(b with gate k "
                            f"flipped) for every gate k, a tensor of shape K x rows = {want}")
        return flips
    mixture = _mixture_flips(p, b)
    if mixture is not None:
        return mixture
    k = b.shape[-1]
    chunk = max(1, _FLIP_CHUNK // max(1, b.numel()))
    eye = torch.eye(k, dtype=b.dtype, device=b.device)
    out = []
    for start in range(0, k, chunk):
        flip = eye[start:start + chunk].reshape((-1,) + (1,) * (b.dim() - 1) + (k,))
        out.append(p.log_prob((b - flip).abs()))  # |b - e_k|: b with gate k flipped
    return torch.cat(out)


def _mixture_flips(p: Distribution, b: torch.Tensor) -> torch.Tensor | None:
    """The flipped log-densities of a mixture of Bernoulli products in one pass, K x rows; None for another law.

    Flipping gate k changes component c's log-density by (1 - 2 b_k) logit_ck, so log p(b with k flipped) =
    logsumexp_c [log w_c + log p_c(b) + (1 - 2 b_k) logit_ck]: rows x C x K work, a few times one log-density, where
    K evaluations of the mixture cost K times it.
    """
    if not isinstance(p, MixtureSameFamily):
        return None
    components = p.component_distribution
    if not (isinstance(components, Independent) and components.reinterpreted_batch_ndims == 1
            and isinstance(components.base_dist, Bernoulli)):
        return None
    per_component = p.mixture_distribution.logits + components.log_prob(b.unsqueeze(-2))  # rows x C
    flips = per_component.unsqueeze(-1) + (1 - 2 * b).unsqueeze(-2) * components.base_dist.logits  # rows x C x K
    return flips.logsumexp(-2).movedim(-1, 0)
