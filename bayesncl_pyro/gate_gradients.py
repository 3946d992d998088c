"""How biased are the gate estimators' gradients? Each against an unbiased gradient of the same objective.

The gating head's objective, per row as the trainer minimises it, is

    E_q[mean_i l_i(g)] + lambda * mean_i sum_k KL(q(g_ik | x_i) || p(g_ik)),

with q(g | x) the estimator's Bernoulli (``guides/gates.py``: its ``probs`` is the true inclusion
probability) and l_i the InfoNCE of row i on the gated features. The estimators differ only in the
gradient of the first term: ``ste`` takes it at the mode, ``relaxed`` and ``gs`` through a relaxed draw;
none is the gradient of the expectation. ``gs-reference-kl`` differs in the second term too: it trains
with the reference's KL at sigmoid(l), while its reference here is ``gs``'s objective (the KL at q's own
probability), so its bias includes the KL surrogate's.

The unbiased gradient used here is exact in each gate and Monte Carlo over the others (the local
expectation gradient): q is a product of Bernoullis, so with p_ik = P(g_ik = 1 | x_i),

    d E_q[sum_i l_i] / d logit_ik = p_ik' * E_q[ D_ik(g) ],   D_ik(g) = sum_j l_j(g, g_ik = 1) - sum_j l_j(g, g_ik = 0),

where D_ik does not depend on g_ik itself. :func:`flip_differences` computes every D_ik of one draw at once:
flipping g_ik changes row i of the gated features only, so the new losses follow from the old
similarities, row i's new ones and each row's log-partition (O(R^2 K) for all R K flips, not O(R^3 K^2)).
The sum runs over every row, so the negatives' dependence on g_ik is kept: this is where an estimator that
treated the rows as independent would go wrong. ``tests/test_gate_gradients.py`` checks the identity
against exact enumeration of every gate configuration of a small batch.
"""

import math

import torch

from bayesncl_pyro.errors import UserError
from bayesncl_pyro.guides.gates import GATES, gate_class
from bayesncl_pyro.losses import bernoulli_kl_grad, normalize, partner_rows

_CHUNK_ELEMENTS = 2**22  # rows of flips are processed in chunks of about this many R x K x R entries


@torch.no_grad()
def flip_differences(features: torch.Tensor, gates: torch.Tensor, temperature: float) -> torch.Tensor:
    """D (R x K, float64): D_ik = sum_j l_j with g_ik set to 1 minus the same with g_ik set to 0.

    features: R x K non-negative features before gating (rows ``[view 1; view 2]``); gates: R x K in {0, 1};
    l_j: ``info_nce_rows(normalize(features * gates), temperature)``, a gated-off row counting as zero.
    """
    f, g = features.double(), gates.double()
    rows, dims = f.shape
    w = f * g
    u = normalize(w)
    sim = (u @ u.T / temperature).fill_diagonal_(-math.inf)
    lse = sim.logsumexp(1)  # R: each row's log-partition over the other rows
    dots = w @ u.T  # R x R: w_i . u_j
    sq = (w * w).sum(1)  # R: ||w_i||^2
    partner = partner_rows(rows, f.device)
    out = torch.empty(rows, dims, dtype=torch.float64, device=f.device)
    chunk = max(1, _CHUNK_ELEMENTS // (dims * rows))
    for start in range(0, rows, chunk):
        i = torch.arange(start, min(start + chunk, rows), device=f.device)
        fi, wi = f[i, :, None], w[i, :, None]  # c x K x 1
        rest = dots[i, None, :] - wi * u.T  # c x K x R: w_i . u_j without entry k
        rest_sq = sq[i, None] - w[i] ** 2  # c x K
        self_col = torch.nn.functional.one_hot(i, rows).bool()[:, None, :]  # c x 1 x R
        total = []
        for b in (0.0, 1.0):
            norm = (rest_sq + b * f[i] ** 2).clamp_min(0).sqrt()[..., None]  # c x K x 1
            s = torch.where(norm > 1e-12, (rest + b * fi * u.T) / norm.clamp_min(1e-12), 0.0) / temperature
            s = s.masked_fill(self_col, -math.inf)  # c x K x R: row i's new similarities
            pos = s.gather(2, partner[i, None, None].expand(-1, dims, 1))[..., 0]
            own = s.logsumexp(2) - pos  # row i's new loss
            # every other row j: its log-partition with S_ji replaced (S is symmetric), and row i's partner
            # also loses its positive term -S_(p(i), i) = -s_(i, p(i))
            old = sim[i][:, None, :]
            others = torch.log1p(torch.exp(s - lse) - torch.exp(old - lse)).sum(2)
            total.append(own + others - pos)
        out[i] = total[1] - total[0]
    return out


def unbiased_gradient(features: torch.Tensor, logits: torch.Tensor, gate, rate: torch.Tensor, kl_weight: float,
                      kl_clamp: float, temperature: float, draws: int) -> torch.Tensor:
    """Unbiased draws (S x R x K, float64) of the gradient of E_q[mean_i l_i] + lambda * mean_i sum_k KL_ik with
    respect to the R x K logits, q = ``gate(logits)``'s Bernoulli: one per gate draw from q, each exact in its
    own gate (module docstring), with the KL's exact gradient; their mean estimates the gradient.
    """
    rows = features.shape[0]
    logits = logits.detach().double().requires_grad_()
    q = gate(logits)
    dprob, = torch.autograd.grad(q.probs.sum(), logits)  # each probability depends on its own logit only
    dkl = kl_weight / rows * bernoulli_kl_grad(q.probs, rate.double(), kl_clamp) * dprob
    return torch.stack([dprob * flip_differences(features, q.sample(), temperature) / rows + dkl
                        for _ in range(draws)])


def _head_gradient(logits: torch.Tensor, params: list, upstream: torch.Tensor) -> torch.Tensor:
    """The head's parameter gradient of a loss whose gradient with respect to the logits is ``upstream``."""
    return _flat(torch.autograd.grad(logits, params, grad_outputs=upstream.to(logits.dtype), retain_graph=True))


def _flat(grads) -> torch.Tensor:
    """Parameter gradients as one float64 vector."""
    return torch.cat([g.reshape(-1) for g in grads]).double()


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


def gate_gradient_bias(learner, x: torch.Tensor, estimators=tuple(GATES), draws: int = 64,
                       reference_draws: int = 64) -> list[dict]:
    """Each estimator's gradient of the gating head against the unbiased gradient, on one batch x (2B rows
    ``[view 1; view 2]``) of a trained BayesNCL learner whose prior has no global latents.

    For every estimator (the head's weights as trained, only the estimator swapped) returns a dict:
    ``cosine``, ``relative_error`` (||mean - unbiased|| / ||unbiased||) and ``norm_ratio``
    (||mean|| / ||unbiased||) of its mean head gradient over ``draws`` draws (one for the deterministic
    ``ste``), which removes its noise and leaves its bias;
    ``single_draw_cosine``, the mean cosine of one draw's gradient (one training step); ``split_cosine`` and
    ``reference_split_cosine``, the cosine between the mean gradients of two halves of the estimator's draws
    and of the unbiased estimate's ``reference_draws`` draws (near 1: the mean is precise enough to judge by;
    straight-through gradients are heavy-tailed, so a sampled estimator may need many draws). The encoder
    runs once, in eval mode.
    """
    if not learner.gated:
        raise UserError("the gradient diagnostic needs a bayesncl run: an NCL or CL run has no gates")
    guide, model = learner.guide, learner.model
    if guide.rate_guide is not None:
        raise UserError(f"the gradient diagnostic needs a prior without global latents (bernoulli, learned), "
                        f"not {model.prior.name}")
    if draws < 1 or reference_draws < 2:
        raise UserError(f"need at least 1 draw per estimator and 2 reference draws, got {draws} and {reference_draws}")
    trained, training = guide.gate, learner.training
    learner.eval()
    with torch.no_grad():
        h = learner.backbone(x).float()
        z = learner.head.projector(h)
        features = model.features(z)
    rate = model.prior.rate().detach()
    params = list(guide.head.parameters())
    logits = guide.logits(h)
    results, references = [], {}  # estimators with the same q (ste and relaxed; gs and its variant) share one
    try:
        for name in estimators:
            gate = gate_class(name)
            guide.gate = gate
            if gate.inclusion not in references:
                per_draw = unbiased_gradient(features, logits, gate, rate, guide.kl_weight, guide.kl_clamp,
                                             model.temperature, reference_draws)
                references[gate.inclusion] = [_head_gradient(logits, params, d.mean(0))
                                              for d in (per_draw, *per_draw.chunk(2))]
            ref_head, *halves = references[gate.inclusion]
            # the estimator's own gradients, through the training program
            heads = []
            for _ in range(1 if name == "ste" else draws):
                loss = learner.head.elbo_terms(z, h)[0]
                heads.append(_flat(torch.autograd.grad(loss, params)))
            mean = torch.stack(heads).mean(0)
            results.append(dict(
                estimator=name, cosine=_cosine(mean, ref_head),
                relative_error=((mean - ref_head).norm() / ref_head.norm()).item(),
                norm_ratio=(mean.norm() / ref_head.norm()).item(),
                single_draw_cosine=sum(_cosine(g, ref_head) for g in heads) / len(heads),
                split_cosine=_cosine(*(torch.stack(part).mean(0) for part in (heads[::2], heads[1::2])))
                if len(heads) > 1 else 1.0,
                reference_split_cosine=_cosine(*halves), draws=len(heads), reference_draws=reference_draws))
    finally:
        guide.gate = trained
        learner.train(training)
    return results
