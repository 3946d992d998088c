"""The gates as a loss module for your own training loop, on any backbone: :class:`BayesNCLHead`.

    backbone = torchvision.models.resnet50()
    backbone.fc = torch.nn.Identity()                                   # images -> h, R x 2048
    head = BayesNCLHead(2048, num_train=len(train_set))
    optimizer = torch.optim.SGD(head.param_groups(lr=0.3, backbone=backbone), lr=0.3, momentum=0.9)
    loss, stats = head(backbone(torch.cat([view1, view2])))             # rows [view 1; view 2]

The head takes the backbone's features h, not projections: it owns the projector (h -> z, the reference's
2-layer MLP), the gating head that infers the gates from h.detach(), the prior, the Pyro model and guide
and the ELBO, so the backbone is all a training loop brings. Its loss is ``-ELBO / 2N``, the paper's
InfoNCE + lambda * KL per row (``models/bayesncl.py``). With ``prior=None`` the same head is NCL (no gates),
and with ``nonneg="none"`` as well, SimCLR; the Trainer trains all three through it.
"""

import pyro
import torch
from torch import nn

from bayesncl_pyro import distributed
from bayesncl_pyro.config import NONNEG
from bayesncl_pyro.diagnostics import gate_pulls
from bayesncl_pyro.elbo import MeanFieldELBO
from bayesncl_pyro.encoders import mlp
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.guides.gates import GATES, GateGuide
from bayesncl_pyro.losses import REFERENCE_KL_CLAMP, normalize
from bayesncl_pyro.metrics import ACTIVE_EPS
from bayesncl_pyro.models.bayesncl import ContrastiveModel
from bayesncl_pyro.models.priors import Prior, build_prior


def own_params():
    """An empty Pyro param store for the duration: the Pyro modules run inside use their own parameters (a learned
    prior's rate, a Beta posterior), not an entry of the process's global store under the same name, which two
    heads of one process (two runs of compare.py, a user's two models) would share, the second head then
    training a parameter its optimizer does not hold."""
    return pyro.get_param_store().scope()


def _no_guide(z, h):
    """NCL and CL have no latent variables: the ELBO is the likelihood factor alone."""


class BayesNCLHead(nn.Module):
    """Backbone features of 2B view-rows -> (loss, monitoring values).

    Args (named as the command-line flags of ``experiments/run_svi.py``; the defaults are the published CIFAR
    recipe's):
        in_dim: D, the backbone's feature width.
        proj_dim: K, the number of features and gates; proj_hidden: the projector's and gating head's width.
        num_train: N, images in the training set (the ELBO's rows plate is 2N).
        prior: a registry name (``bernoulli``, ``learned``, ``beta-bernoulli``), ``package.module:Class``, a
            :class:`~bayesncl_pyro.models.priors.Prior`, or None for NCL / CL (no gates).
        prior_prob: rho, the prior inclusion rate (or its mean); prior_args: the prior's other arguments.
        kl_weight: lambda; kl_clamp: the KL's rates are clamped to [c, 1 - c] (0.01 as the reference, 0 = the
            exact KL); gate: the gate estimator, a name in ``guides/gates.py``'s ``GATES`` (``ste``, ``relaxed``,
            ``gs``, ``gs-reference-kl``); gate_temperature, head_depth, logit_bound: the guide's.
        temperature: InfoNCE tau; nonneg: ``rep_relu`` | ``relu`` | ``none`` (SimCLR); topk: keep the k
            largest features per row (0: all).
        gather_distributed: under ``torch.distributed`` with several ranks, contrast each row against the rows
            of every rank (global negatives; a plain run is unaffected).
    """

    def __init__(self, in_dim: int, proj_dim: int = 256, proj_hidden: int = 2048, *, num_train: int,
                 prior: str | Prior | None = "bernoulli", prior_prob: float = 0.8, prior_args: dict | None = None,
                 kl_weight: float = 3e-5, kl_clamp: float = REFERENCE_KL_CLAMP, gate: str = "ste",
                 gate_temperature: float = 1.0, head_depth: int = 2,
                 logit_bound: float = 5.0, temperature: float = 0.2, nonneg: str = "rep_relu", topk: int = 0,
                 gather_distributed: bool = False):
        super().__init__()
        if gate not in GATES or nonneg not in NONNEG:
            raise UserError(f"unknown gate {gate!r} or nonneg {nonneg!r}; gate is one of {', '.join(GATES)}, "
                            f"nonneg one of {', '.join(NONNEG)}")
        self.projector = mlp(in_dim, proj_hidden, proj_dim)
        if prior is not None and not isinstance(prior, Prior):
            prior = build_prior(prior, proj_dim, prior_prob, **(prior_args or {}))
        if prior is not None and prior.num_features != proj_dim:
            raise UserError(f"the prior has {prior.num_features} gates but the head {proj_dim} features")
        num_rows = 2 * num_train
        self.model = ContrastiveModel(num_rows, temperature, nonneg, topk, prior, kl_weight)
        self.guide = GateGuide(
            in_dim, proj_hidden, proj_dim, num_rows, depth=head_depth, estimator=gate, temperature=gate_temperature,
            logit_bound=logit_bound, kl_weight=kl_weight, kl_clamp=kl_clamp, rate_guide=prior.make_guide(),
        ) if prior is not None else None
        if gather_distributed:
            self.model.gather = distributed.gather_rows
        self.elbo = MeanFieldELBO()

    @property
    def gated(self) -> bool:
        return self.guide is not None

    @property
    def num_rows(self) -> int:
        return self.model.num_rows

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """h: R x D backbone features of the rows ``[view 1 of B images; view 2 of the same B images]``.

        Returns ``-ELBO / 2N`` and a dict of detached values: 0-d ``nce`` (mean InfoNCE), ``kl`` (per row, summed
        over the gates), ``active`` (share of feature entries that take part in the loss) and with gates
        ``gate_rate``, ``incl_min``, ``incl_max`` (mean inclusion probability q(g = 1 | x) over all entries,
        and of the least and most included dimension); R x K ``features`` (the rows InfoNCE saw) and with gates
        ``probs`` (q(g = 1 | x)) and ``gates`` (the gate values, whose gradient :meth:`pulls` reads after
        ``loss.backward()``), K ``prior_rate`` (the prior's mean inclusion rate at this step). The 0-d values
        stay on the device: ``.item()`` them when you log.
        """
        z = self.projector(h)  # under the caller's autocast, if any
        seen = {}

        def model(z, h):
            seen.update(self.model(z, h))

        def guide(z, h):
            seen["probs"] = self.guide(z, h)

        dtype = self.projector[0].weight.dtype
        with torch.autocast(h.device.type, enabled=False), own_params():  # the exp and log of the loss in full
            loss = self.elbo.differentiable_loss(model, guide if self.gated else _no_guide, z.to(dtype), h.to(dtype))
            loss = loss / self.num_rows
            nce, u = seen["nce"].detach().mean(), seen["features"]
            kl = (loss.detach() - nce) / self.model.kl_weight if self.gated else torch.zeros_like(nce)
            stats = dict(nce=nce, kl=kl, active=(u.abs() > ACTIVE_EPS).float().mean(), features=u)
            if self.gated:
                probs = seen["probs"]
                per_dim = probs.mean(0)
                stats.update(gate_rate=probs.mean(), incl_min=per_dim.min(), incl_max=per_dim.max(), probs=probs,
                             gates=seen["gates"], prior_rate=self.model.prior.mean_rate())
        return loss, stats

    def pulls(self, stats: dict) -> dict[str, float]:
        """After ``loss.backward()``: how hard InfoNCE and the prior pull on the gates of that step
        (``gate_nce_pull``, ``gate_prior_pull``: ``diagnostics.gate_pulls``); empty before, or without gates."""
        gates = stats.get("gates")
        if gates is None or gates.grad is None:
            return {}
        nce, prior = gate_pulls(gates.grad, stats["probs"], stats["prior_rate"], self.model.kl_weight,
                                self.guide.kl_clamp)
        return dict(gate_nce_pull=nce, gate_prior_pull=prior)

    def gate_probs(self, h: torch.Tensor) -> torch.Tensor:
        """The posterior inclusion probabilities q(g_k = 1 | x) under the head's gate estimator, R x K, from
        backbone features h."""
        return self.guide.inclusion_probs(h)

    @torch.no_grad()
    def representation(self, h: torch.Tensor) -> torch.Tensor:
        """F, the representation the method uses, for evaluation: normalise(features(z) * m) with m the posterior
        mode 1[q(g = 1 | x) > 0.5] with gates, features(z) without (normalise(relu(z)) for NCL, normalise(z) for
        CL)."""
        feats = self.model.features(self.projector(h))
        if self.gated:
            feats = normalize(feats * (self.gate_probs(h) > 0.5).to(feats))
        return feats

    @torch.no_grad()
    def ungated_features(self, h: torch.Tensor) -> torch.Tensor:
        """The features of backbone features h with every gate open: normalise(relu(z)), as NCL's."""
        return self.model.features(self.projector(h))

    def param_groups(self, lr: float, gate_lr: float = 0.1, backbone: nn.Module | None = None,
                     adam: bool = False) -> list[dict]:
        """Optimizer groups: the backbone (if given) and the projector at ``lr``; the gating head at ``gate_lr``
        (0.1 published, not batch-scaled); the prior's global parameters, whose whole objective sits inside the
        lambda-weighted KL, at gate_lr / lambda so that their step size does not depend on lambda (at gate_lr for
        ``adam``, which is scale-free)."""
        encoder = [*(backbone.parameters() if backbone is not None else ()), *self.projector.parameters()]
        groups = [dict(name="encoder", params=encoder, lr=lr)]
        if self.gated:
            glob = [*self.model.parameters(),
                    *(p for n, p in self.guide.named_parameters() if not n.startswith("head."))]
            groups.append(dict(name="gate_head", params=list(self.guide.head.parameters()), lr=gate_lr))
            if glob:
                scale = 1.0 if adam else 1.0 / self.model.kl_weight
                groups.append(dict(name="prior", params=glob, lr=gate_lr * scale, weight_decay=0.0))
        return groups
