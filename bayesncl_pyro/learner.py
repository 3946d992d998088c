"""The trainable object: encoder -> (model, guide) -> -ELBO per row, for CL, NCL and BayesNCL alike."""

import torch
from torch import nn

from bayesncl_pyro.config import Config
from bayesncl_pyro.elbo import MeanFieldELBO
from bayesncl_pyro.encoders import Encoder
from bayesncl_pyro.losses import normalize
from bayesncl_pyro.guides.gates import GateGuide
from bayesncl_pyro.models.bayesncl import ContrastiveModel
from bayesncl_pyro.models.priors import build_prior


def _no_guide(z, h):
    """NCL and CL have no latent variables: the ELBO is the likelihood factor alone."""


class ContrastiveLearner(nn.Module):
    """Owns the encoder, the Pyro model and guide, and the ELBO.

    ``forward(x)`` takes the 2B view-rows ``[view 1; view 2]`` and returns ``-ELBO / num_rows``:
    InfoNCE + lambda * KL per row (see ``models/bayesncl.py``). Being an ``nn.Module`` whose forward
    returns the loss, it can be wrapped by DDP as it is.
    """

    def __init__(self, cfg: Config, in_channels: int, num_train: int):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg.encoder, in_channels, cfg.image_size, cfg.proj_hidden, cfg.proj_dim)
        num_rows = 2 * num_train
        gated = cfg.method == "bayesncl"
        prior = build_prior(cfg.prior, cfg.proj_dim, cfg.prior_prob) if gated else None
        self.model = ContrastiveModel(num_rows, cfg.temperature, cfg.nonneg, cfg.topk, prior, cfg.kl_weight)
        self.guide = GateGuide(
            self.encoder.feat_dim, cfg.proj_hidden, cfg.proj_dim, num_rows, depth=cfg.head_depth,
            estimator=cfg.gate, temperature=cfg.gate_temperature, logit_bound=cfg.logit_bound,
            kl_weight=cfg.kl_weight, kl_clamp=cfg.kl_clamp, rate_guide=prior.make_guide(),
        ) if gated else None
        self.elbo = MeanFieldELBO()

    @property
    def gated(self) -> bool:
        return self.guide is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # autocast covers the encoder only; the Pyro program runs at the input's precision (exp/log of the loss)
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.cfg.amp and x.is_cuda):
            h, z = self.encoder(x)
        guide = self.guide if self.gated else _no_guide
        loss = self.elbo.differentiable_loss(self.model, guide, z.to(x.dtype), h.to(x.dtype))
        return loss / self.model.num_rows

    @torch.no_grad()
    def representation(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, F): backbone features and the representation the method uses, for evaluation.

        F = normalise(features(z) * m) with m the posterior mode 1[q(g=1|x) > 0.5] for BayesNCL,
        F = features(z) for NCL (normalise(relu(z))) and CL (normalise(z)).
        """
        h, z = self.encoder(x)
        h, z = h.float(), z.float()
        feats = self.model.features(z)
        if self.gated:
            feats = normalize(feats * (self.gate_probs(h) > 0.5).to(feats))
        return h, feats

    @torch.no_grad()
    def ungated_features(self, h: torch.Tensor) -> torch.Tensor:
        """The features of backbone features h with every gate open: normalise(relu(z)), as NCL's."""
        return self.model.features(self.encoder.projector(h))

    def gate_probs(self, h: torch.Tensor) -> torch.Tensor:
        """Exact posterior inclusion probabilities q(g_k = 1 | x) under the run's gate estimator, R x K."""
        return self.guide.inclusion_probs(h)

    def param_groups(self) -> list[dict]:
        """Optimizer groups: encoder at the batch-scaled base lr; gating head at its own lr (0.1 published,
        not batch-scaled); the prior's global parameters, whose whole objective sits inside the
        lambda-weighted KL, at gate_lr / lambda so that their step size does not depend on lambda."""
        cfg = self.cfg
        groups = [dict(name="encoder", params=list(self.encoder.parameters()),
                       lr=cfg.lr * cfg.batch_size / 256)]
        if self.gated:
            glob = [p for p in self.model.parameters()] + [p for n, p in self.guide.named_parameters()
                                                            if not n.startswith("head.")]
            groups.append(dict(name="gate_head", params=list(self.guide.head.parameters()), lr=cfg.gate_lr))
            if glob:
                scale = 1.0 if cfg.optimizer == "adamw" else 1.0 / cfg.kl_weight  # Adam is scale-free
                groups.append(dict(name="prior", params=glob, lr=cfg.gate_lr * scale, weight_decay=0.0))
        return groups
