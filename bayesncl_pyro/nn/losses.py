"""The contrastive maths as pure functions: InfoNCE, the Bernoulli KL, non-negativity, top-k.

Shapes: B images, 2 views each, give R = 2B *rows* stacked as ``[view 1 of all images; view 2]``,
so row ``i`` and row ``(i + B) % R`` are the positive pair. K is the feature width.
"""

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

#: the reference clamps both the posterior and the prior inclusion rate to [0.01, 0.99] before its KL
REFERENCE_KL_CLAMP = 0.01


def partner_rows(rows: int, device=None) -> torch.Tensor:
    """The index of each row's positive, the other view of its image.

    ``(i + R / 2) % R`` for rows
    ``[view 1 of B images; view 2 of the same B images]``.
    """
    return (torch.arange(rows, device=device) + rows // 2) % rows


def info_nce_rows(u: torch.Tensor, temperature: float, columns: torch.Tensor | None = None,
                  offset: int = 0) -> torch.Tensor:
    """Per-row NT-Xent loss of SimCLR.

    Args:
        u: R x K rows, L2-normalised (a row that is all zero is allowed: its similarities are 0).
        temperature: tau > 0.
        columns: C x K rows to contrast against, with ``u`` at rows ``offset .. offset + R`` of it
            (the features of all ranks under DDP); defaults to ``u`` itself.
        offset: where ``u``'s rows start among ``columns``' (this rank's offset under DDP).

    Returns:
        R losses ``-log(pos / (pos + neg))``, where pos is the similarity to the row's other view and
        neg sums over the rows of all other images (the row itself is excluded from both).
    """
    cols = u if columns is None else columns
    rows, total = u.shape[0], cols.shape[0]
    logits = u @ cols.T / temperature                                   # R x C
    idx = torch.arange(rows, device=u.device)
    self_col = idx + offset
    # columns hold [view 1 of all images; view 2 of all images] per rank: the partner is in the same rank block
    pos_col = offset + partner_rows(rows, u.device)
    # the row's own column, by comparison: F.one_hot would check its indices on the host (on a CPU; CUDA's doesn't)
    logits = logits.masked_fill(self_col[:, None] == torch.arange(total, device=u.device), float("-inf"))
    return torch.logsumexp(logits, dim=1) - logits[idx, pos_col]


def info_nce_flip_differences(features: torch.Tensor, gates: torch.Tensor, temperature: float,
                               max_elements: int = 2**24, every_flip: bool | None = None,
                               fused: bool | None = None) -> torch.Tensor:
    """Every gate's exact effect on the batch's InfoNCE.

    D (R x K), D_ik = sum_j l_j with g_ik = 1 minus the same
    with g_ik = 0, the other gates as given; l_j = ``info_nce_rows(normalize(features * gates), temperature)``.

    Args:
        features: R x K features before gating (rows ``[view 1; view 2]``).
        gates: R x K in {0, 1}.
        temperature: tau > 0.
        max_elements: a bound on the flips x R work held at once (the flips are taken in chunks under it).
        every_flip: compute the flips of zero features too (same result); default: on a GPU, where picking the
            others would make the host wait for their count.
        fused: each chunk through ``torch.compile`` (Inductor: on a GPU a Triton kernel), one pass that reduces the
            flips' R terms as it computes them, where eager PyTorch writes and reads several flips x R
            temporaries; default: on a GPU (a compile takes seconds to a minute, once per process and shape).

    Returns:
        D in the dtype of ``features``, detached; 0 exactly where a feature is 0 (its gate changes nothing).

    The O(R^2 K) algorithm and its float32 error (float64 below temperature 0.025): docs/METHOD.md, "The ELBO's
    gradient through the gates".
    """
    f, g = features.detach(), gates.detach().to(features.dtype)
    if f.dtype == torch.float32 and temperature < 0.025:
        return info_nce_flip_differences(f.double(), g, temperature, max_elements, every_flip, fused).float()
    rows, dims = f.shape
    w = f * g
    u = normalize(w)
    sim = (u @ u.T / temperature).fill_diagonal_(float("-inf"))  # R x R, self excluded
    lse = sim.logsumexp(1)  # R: each row's log-partition over the other rows
    current = _CurrentState(
        f.flatten(), (1 - 2 * g).flatten(), (w * w).sum(1), w @ u.T, u.T.contiguous(), sim, lse,
        (sim - lse).exp(), (-lse).exp(), partner_rows(rows, f.device))
    every_flip = f.is_cuda if every_flip is None else every_flip
    flips = torch.arange(rows * dims, device=f.device) if every_flip else (f.flatten() != 0).nonzero()[:, 0]
    chunk_differences = _fused_flip_chunk() if (f.is_cuda if fused is None else fused) else _flip_chunk
    out = torch.zeros(rows * dims, dtype=f.dtype, device=f.device)
    chunk = max(1, max_elements // rows)
    for start in range(0, len(flips), chunk):  # a few chunks of flips: memory, not a loop over gates or rows
        flat = flips[start:start + chunk]
        out[flat] = chunk_differences(flat, *current, temperature)
    return torch.where(f != 0, out.view(rows, dims), 0.0)


class _CurrentState(NamedTuple):
    """What every flip of :func:`info_nce_flip_differences` reads: the batch's current gated state."""

    features: torch.Tensor  # R K: f_ik, flat (index i * K + k)
    step: torch.Tensor  # R K: +1 where the flip opens the gate, -1 where it closes it
    sq: torch.Tensor  # R: ||w_i||^2, w = f * g
    dots: torch.Tensor  # R x R: w_i . u_j, u = normalize(w)
    columns: torch.Tensor  # K x R: u_jk, row k
    sim: torch.Tensor  # R x R: S_ij = u_i . u_j / tau, -inf on the diagonal
    lse: torch.Tensor  # R: each row's log-partition over the other rows
    weight: torch.Tensor  # R x R: exp(S_ij - lse_j), row j's softmax weight on row i (S is symmetric)
    inv_partition: torch.Tensor  # R: exp(-lse_j)
    partner: torch.Tensor  # R: the index of each row's positive


def _flip_chunk(flat: torch.Tensor, features, step, sq, dots, columns, sim, lse, weight, inv_partition, partner,
                temperature: float) -> torch.Tensor:
    """D of the flips ``flat`` from the current state.

    ``flat``: M flat indices i * K + k; the state: :class:`_CurrentState`. Eager, it
    holds two M x R tensors at a time (its in-place ops); compiled (:func:`_fused_flip_chunk`), every M x R term is
    computed where one of the three reductions over the rows j consumes it.
    """
    rows, dims = dots.shape[0], columns.shape[0]
    i, k, sign = flat // dims, flat % dims, step[flat]
    fik = features[flat]
    norm = (sq[i] + sign * fik**2).clamp_min(0).sqrt()  # M: ||w_i|| after the flip
    # row i's new similarities S_ij = (w_i . u_j + sign f_ik u_jk) / ||w_i'|| / tau, 0 for a row left empty
    s = dots.index_select(0, i).addcmul_((sign * fik)[:, None], columns.index_select(0, k))
    s = s.mul_(torch.where(norm > 1e-12, 1 / (norm.clamp_min(1e-12) * temperature), 0.0)[:, None])
    e = s.exp_()  # M x R, at most e^(1 / tau)
    e.masked_fill_(torch.arange(rows, device=e.device) == i[:, None], 0.0)  # the row itself is no negative
    m = torch.arange(len(flat), device=e.device)
    pos_change = e[m, partner[i]].log() - sim[i, partner[i]]  # S_(i, p(i)): row i's positive, and p(i)'s
    own = e.sum(1).log() - lse[i]  # row i's log-partition, new - old
    # every other row j: its log-partition with S_ji replaced, log(1 + new weight - old weight)
    others = e.mul_(inv_partition).sub_(weight.index_select(0, i)).log1p_().sum(1)
    return sign * (own + others - 2 * pos_change)


@functools.cache
def _fused_flip_chunk():
    """:func:`_flip_chunk` compiled, for any number of flips (a dynamic first dimension: one compile per process)."""
    return torch.compile(_flip_chunk, dynamic=True, fullgraph=True)


def info_nce(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """The reference NT-Xent mean over all 2B rows.

    Args:
        z1: B x K, L2-normalised: the first views.
        z2: B x K, L2-normalised: row i is the second view of the image of row i of ``z1``.
        temperature: tau > 0.

    Returns:
        a scalar.
    """
    return info_nce_rows(torch.cat([z1, z2]), temperature).mean()


def bernoulli_kl(alpha: torch.Tensor, rho: torch.Tensor | float, clamp: float) -> torch.Tensor:
    """Elementwise KL(Bernoulli(alpha) || Bernoulli(rho)), both rates clamped to [clamp, 1 - clamp].

    ``clamp = 0`` is the exact KL (to float precision: the rates are kept one float eps inside (0, 1), as
    torch's own Bernoulli KL does, so that a gate that is surely on has a finite KL and a zero, not NaN,
    gradient). The reference clamps at 0.01 (:data:`REFERENCE_KL_CLAMP`): that bounds the KL, so the prior
    can never push a logit to infinity, but it is not the KL: KL(0.5 || 0.999) is 1.61 clamped against 2.76,
    and a rate past the clamp (sigmoid(l) > 0.99 at l > 4.6) gets no gradient from it.

    Args:
        alpha: q's inclusion probabilities pi (any shape).
        rho: the prior's rate, a number or a tensor that broadcasts against ``alpha``.
        clamp: c, both rates clamped to [c, 1 - c]; 0 for the exact KL.

    Returns:
        The KL of each gate, ``alpha``'s shape: ``pi log(pi / rho) + (1 - pi) log((1 - pi) / (1 - rho))``.
    """
    lo = max(clamp, torch.finfo(alpha.dtype).eps)
    alpha = alpha.clamp(lo, 1 - lo)
    rho = torch.as_tensor(rho, dtype=alpha.dtype, device=alpha.device).clamp(lo, 1 - lo)
    return alpha * (alpha / rho).log() + (1 - alpha) * ((1 - alpha) / (1 - rho)).log()


def bernoulli_kl_grad(alpha: torch.Tensor, rho: torch.Tensor | float, clamp: float) -> torch.Tensor:
    """The elementwise gradient of ``bernoulli_kl`` in ``alpha``, zero past the clamp.

    At detached alpha and rho: how hard the prior pulls each gate (``infer.head.gate_pulls``, the KL part of
    ``gate_gradients``).
    """
    alpha = alpha.detach().requires_grad_()
    rho = rho.detach() if torch.is_tensor(rho) else rho
    with torch.enable_grad():
        grad, = torch.autograd.grad(bernoulli_kl(alpha, rho, clamp).sum(), alpha)
    return grad


def normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Row-wise L2 normalisation (R x K) that maps an all-zero row to zero *with zero gradient*.

    ``F.normalize`` divides by ``max(||x||, eps)``, so at a zero row (every gate off, or every feature
    dead) its gradient is 1 / eps = 1e12: through the straight-through gates that blows up the gating
    head. Such a row contributes nothing, and here it also receives nothing.
    """
    norm = x.norm(dim=1, keepdim=True)
    # written so that a NaN norm falls in the second branch: NaNs must surface, not become zeros
    return torch.where(norm <= eps, torch.zeros_like(x), x / norm.clamp_min(eps))


def bound_logits(raw: torch.Tensor, bound: float) -> torch.Tensor:
    """Gate logits b tanh(raw / b), in (-b, b): the reference's logit bound.

    Every gate's probability stays inside (sigmoid(-b), sigmoid(b)), so the KL and the straight-through gradient stay
    finite. ``raw``: any shape (R x K gate logits before the bound); ``bound``: b > 0.
    """
    return bound * torch.tanh(raw / bound)


NONNEG = ("relu", "rep_relu", "none")
"""The kinds of :func:`nonneg` (``--nonneg``)."""


def nonneg(z: torch.Tensor, kind: str) -> torch.Tensor:
    """Make features non-negative.

    ``relu``: plain ReLU. ``rep_relu``: ReLU forward, GELU's gradient backward, so a unit that is
    off still receives gradient and can switch back on. ``none``: identity (SimCLR).
    """
    if kind == "relu":
        return F.relu(z)
    if kind == "rep_relu":
        g = F.gelu(z)
        return g - g.detach() + F.relu(z).detach()
    if kind == "none":
        return z
    raise ValueError(f"unknown non-negativity {kind!r}; expected {', '.join(NONNEG)}")


def topk_mask(z: torch.Tensor, k: int) -> torch.Tensor:
    """A constant 0/1 mask (R x K) keeping the k largest entries of each row (the NCL+TopK baseline)."""
    idx = z.detach().topk(k, dim=1).indices
    return torch.zeros_like(z).scatter_(1, idx, 1.0)


ACTIVE_EPS = 1e-5
"""|F| above this counts as an active entry (the reference's threshold)."""
