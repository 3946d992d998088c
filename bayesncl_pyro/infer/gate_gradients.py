"""How biased are the gate estimators' gradients? Each against an unbiased gradient of the same objective.

The gating head's objective, per row as the trainer minimises it, is

    E_q[mean_i l_i(g)] + lambda * mean_i sum_k KL(q(g_ik | x_i) || p(g_ik)),

with q(g | x) the estimator's family (``guides/gates.py``: its ``probs`` is the true inclusion
probability) and l_i the InfoNCE of row i on the gated features. The estimators differ only in the
gradient of the first term (``bayesncl_pyro/infer/estimators.py``): ``ste`` takes it at the mode, ``relaxed`` and
``gs`` through a relaxed draw, ``st-sampled`` through the local derivative at a draw, and ``leg`` as below.
``gs-reference-kl`` differs in the second term too: it trains
with the reference's KL at sigmoid(l), while its reference here is ``gs``'s objective (the KL at q's own
probability), so its bias includes the KL surrogate's.

The unbiased gradient used here is exact in each gate and Monte Carlo over the others (the local
expectation gradient): q is a product of Bernoullis, so with p_ik = P(g_ik = 1 | x_i),

    d E_q[sum_i l_i] / d logit_ik = p_ik' * E_q[ D_ik(g) ],   D_ik(g) = sum_j l_j(g, g_ik = 1) - sum_j l_j(g, g_ik = 0),

where D_ik does not depend on g_ik itself. ``losses.info_nce_flip_differences`` computes every D_ik of one draw at
once, in O(R^2 K) (docs/METHOD.md, "The ELBO's gradient through the gates"). The sum runs over every row, so the
negatives' dependence on g_ik is kept: this is where an estimator that treated the rows as independent would go
wrong. ``tests/infer/test_gate_gradients.py`` checks the identity against exact enumeration of every gate
configuration of a small batch.
"""

import torch
from pyro import poutine

from bayesncl_pyro.errors import UserError
from bayesncl_pyro.infer.elbo import own_params
from bayesncl_pyro.infer.estimators import GATES, Draw, gate_class
from bayesncl_pyro.infer.kl import gates_of, site_kl
from bayesncl_pyro.models.bayesncl import computed, gate_site, image_features, images_plate
from bayesncl_pyro.nn.losses import bernoulli_kl_grad, info_nce_flip_differences


def unbiased_gradient(features: torch.Tensor, logits: torch.Tensor, family, rate, kl_weight: float,
                      kl_clamp: float, temperature: float, draws: int) -> torch.Tensor:
    """Unbiased draws of the objective's gradient with respect to the logits.

    Unbiased draws (S x R x K, float64) of the gradient of E_q[mean_i l_i] + lambda * mean_i sum_k KL_ik with
    respect to the R x K logits, q = ``family(logits)`` (``guides/gates.py``): one per gate draw from q, each exact
    in its own gate (module docstring), with the KL's gradient; their mean estimates the gradient. ``rate``: the
    prior's Bernoulli rates (K, or R x K; the KL's gradient exact), or a callable that returns p(g) of the R rows at
    one draw of the prior's latents (a coupled prior, a prior with latents of its own): the KL's gradient is then
    the head's own (``infer.kl.site_kl``: exact, or unbiased per gate), at a fresh draw each time.
    """
    rows = features.shape[0]
    logits = logits.detach().double().requires_grad_()
    q = family(logits)
    dprob, = torch.autograd.grad(q.probs.sum(), logits, retain_graph=True)  # each on its own logit only
    if callable(rate):
        def dkl():
            kl = site_kl(q.to_event(1), _double(rate()), None, kl_clamp=kl_clamp)[0].sum()
            return torch.autograd.grad(kl_weight / rows * kl, logits, retain_graph=True)[0]
    else:
        fixed = kl_weight / rows * bernoulli_kl_grad(q.probs, rate.double(), kl_clamp) * dprob

        def dkl():
            return fixed
    return torch.stack([dprob * info_nce_flip_differences(features.double(), q.sample(), temperature) / rows + dkl()
                        for _ in range(draws)])


def _double(p: torch.distributions.Distribution) -> torch.distributions.Distribution:
    """A Bernoulli prior's law in float64, as the reference's q; another distribution as it is."""
    gates, dims = gates_of(p)
    if gates is None:
        return p
    return torch.distributions.Independent(torch.distributions.Bernoulli(probs=gates.probs.double()), dims) \
        if dims else torch.distributions.Bernoulli(probs=gates.probs.double())


def _prior_draw(head, h: torch.Tensor):
    """p(g) of the rows of backbone features h at one draw of the prior's latents from their guide.

    As training takes it, without gradients (the diagnostic differentiates the gating head only).
    """
    prior, rate_guide, rows = head.model.prior, head.guide.rate_guide, h.shape[0]
    with own_params(), torch.no_grad():
        if rate_guide is None:
            return prior(rows, images_plate(head.num_rows, rows, h.device)) if prior.row_latents else prior(rows)
        if prior.row_latents:
            plate = images_plate(head.num_rows, rows, h.device)
            trace = poutine.trace(rate_guide).get_trace(image_features(h), plate)
            return poutine.replay(prior, trace=trace)(rows, plate)
        return poutine.replay(prior, trace=poutine.trace(rate_guide).get_trace())(rows)


def _head_gradient(logits: torch.Tensor, params: list, upstream: torch.Tensor) -> torch.Tensor:
    """The head's parameter gradient of a loss whose gradient with respect to the logits is ``upstream``."""
    return _flat(torch.autograd.grad(logits, params, grad_outputs=upstream.to(logits.dtype), retain_graph=True))


def _flat(grads) -> torch.Tensor:
    """Parameter gradients as one float64 vector."""
    return torch.cat([g.reshape(-1) for g in grads]).double()


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


SCORE = "score"  # the score-function (REINFORCE) gradient of the program as written, for the table only


def gate_gradient_bias(learner, x: torch.Tensor, estimators=(*GATES, SCORE), draws: int = 64,
                       reference_draws: int = 64) -> list[dict]:
    """Each estimator's gating-head gradient against the unbiased gradient, on one batch.

    Each estimator's gradient of the gating head against the unbiased gradient, on one batch x (2B rows
    ``[view 1; view 2]``) of a trained BayesNCL learner, whatever its prior (one of latents of its own: the KL at a
    fresh draw of them from their guide for every reference draw).

    ``estimators``: names in ``GATES``, and ``score``: the score-function (REINFORCE) gradient of InfoNCE at one
    draw of q, no baseline, the KL's gradient exact: unbiased, and the estimator Pyro's ``TraceGraph_ELBO``
    takes on the program as written (one scalar, the batch's InfoNCE, weights every gate's score). For every
    estimator (the head's weights as trained; the estimator and its q family passed to the head's training path,
    the learner left as it was) returns a dict: ``cosine``, ``relative_error`` (||mean - unbiased|| /
    ||unbiased||) and ``norm_ratio`` (||mean|| / ||unbiased||) of its mean head gradient over ``draws`` draws (one
    for the deterministic ``ste``), which removes its noise and leaves its bias;
    ``single_draw_cosine``, the mean cosine of one draw's gradient (one training step); ``split_cosine`` and
    ``reference_split_cosine``, the cosine between the mean gradients of two halves of the estimator's draws
    and of the unbiased estimate's ``reference_draws`` draws (near 1: the mean is precise enough to judge by;
    straight-through gradients are heavy-tailed, so a sampled estimator may need many draws). ``leg`` computes
    the same local expectation gradient as the reference, one draw per step: its row checks that training takes
    it. The encoder runs once, in eval mode.
    """
    if not learner.gated:
        raise UserError("the gradient diagnostic needs a bayesncl run: an NCL or CL run has no gates")
    head, guide, model = learner.head, learner.guide, learner.model
    if draws < 1 or reference_draws < 2:
        raise UserError(f"need at least 1 draw per estimator and 2 reference draws, got {draws} and {reference_draws}")
    trained, training = head.estimator, learner.training
    learner.eval()
    with torch.no_grad():
        h = learner.backbone(x).float()
        z = head.projector(h)
        features = model.features(z)
    def rate():
        return _prior_draw(head, h)
    kl_weight = head.kl_weight
    params = list(guide.head.parameters())
    logits = guide.logits(h)
    results, references = [], {}  # estimators with the same q (ste, relaxed, ...; gs and its variant) share one
    try:
        for name in estimators:
            # the head's weights as trained, this estimator and its q family passed to each step: nothing is swapped
            estimator = gate_class(trained.name if name == SCORE else name)(trained.kl_clamp)
            family = estimator.family
            if family not in references:
                per_draw = unbiased_gradient(features, logits, family, rate, kl_weight, estimator.kl_clamp,
                                             model.temperature, reference_draws)
                references[family] = [_head_gradient(logits, params, d.mean(0))
                                      for d in (per_draw, *per_draw.chunk(2))]
            ref_head, *halves = references[family]
            heads = []
            for _ in range(1 if name == "ste" else draws):
                if name == SCORE:
                    loss = _score_loss(head, z, h, estimator)
                else:  # the training path
                    loss = head.elbo_terms(z, h, estimator=estimator, family=family, kl_weight=kl_weight).loss
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
        learner.train(training)
    return results


def _score_loss(head, z: torch.Tensor, h: torch.Tensor, estimator) -> torch.Tensor:
    """One draw of the score-function surrogate of the head's loss.

    It is taken under ``estimator``'s q family and KL clamp: at a draw g ~ q (no gradient through it), the loss plus
    sg(mean_i l_i(g)) * sum_ik log q(g_ik), whose gradient is InfoNCE's REINFORCE term and the KL's.
    """
    terms = head.elbo_terms(z, h, estimator=Draw(estimator.kl_clamp), family=estimator.family)
    loss, model_trace, guide_trace = terms.loss, terms.model_trace, terms.guide_trace
    site = gate_site(model_trace)
    q, gates = guide_trace.nodes[site["name"]]["fn"].base_dist, site["value"]
    return loss + computed(model_trace)["row_nce"].mean() * q.log_prob(gates).sum()
