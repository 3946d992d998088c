"""The amortized guide q(g | x): a gating head on detached backbone features -> per-row gate distributions.

All three gate estimators are ``RelaxedBernoulliStraightThrough`` distributions: forward a hard 0/1
gate, backward a smooth surrogate, and P(gate on) = sigmoid(logits). They differ only in how the
hard sample and its surrogate are drawn. One KL registration (below) covers all three, so
``TraceMeanField_ELBO`` uses the exact Bernoulli KL instead of a wrong sampled estimate.
"""

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.nn import PyroModule

from bayesncl_pyro.encoders import mlp
from bayesncl_pyro.losses import bernoulli_kl
from bayesncl_pyro.models.bayesncl import rows_plate


class ThresholdGate(dist.RelaxedBernoulliStraightThrough):
    """The reference's deterministic STE gate: 1[alpha > 0.5] forward, identity to alpha backward."""

    def rsample(self, sample_shape=torch.Size()):
        alpha = self.probs.expand(self._extended_shape(sample_shape))
        return (alpha > 0.5).to(alpha) + (alpha - alpha.detach())  # exact 0/1 values


class GumbelSigmoidGate(dist.RelaxedBernoulliStraightThrough):
    """The reference's Gumbel-sigmoid gate (one Gumbel, not the logistic noise of the binary Concrete),
    thresholded at 0.5 with a straight-through gradient."""

    def rsample(self, sample_shape=torch.Size()):
        logits = self.logits.expand(self._extended_shape(sample_shape))
        u = torch.rand_like(logits)
        y = torch.sigmoid((logits - (-(u + 1e-4).log() + 1e-4).log()) / self.temperature)
        return (y > 0.5).to(y) + (y - y.detach())


GATES = {"relaxed": dist.RelaxedBernoulliStraightThrough, "ste": ThresholdGate, "gs": GumbelSigmoidGate}


@torch.distributions.kl.register_kl(dist.RelaxedBernoulliStraightThrough, dist.Bernoulli)
def _kl_gate_bernoulli(q, p):
    """KL of the *discrete* gate: the relaxation only shapes gradients, the gate itself is Bernoulli."""
    return bernoulli_kl(q.probs, p.probs)


class GateGuide(PyroModule):
    """q(rate) q(g | h): the prior's own posterior for global latents (if any) and amortized gates.

    Args:
        in_dim: backbone feature width; hidden, depth: gating-head MLP shape; num_features: K.
        num_rows: rows in the whole training set (2 per image), for minibatch scaling.
        estimator: ``relaxed`` | ``ste`` | ``gs``; temperature: the relaxation temperature.
        logit_bound: logits are squashed smoothly into (-bound, bound): a saturated gate would get no
            gradient and never come back.
        kl_weight: lambda, applied here and in the model (TraceMeanField scales the KL by the guide's scale).
        rate_guide: the prior's variational posterior for its global latents, or None.
    """

    def __init__(self, in_dim: int, hidden: int, num_features: int, num_rows: int, *, depth: int = 2,
                 estimator: str = "relaxed", temperature: float = 1.0, logit_bound: float = 5.0,
                 kl_weight: float = 3e-5, rate_guide: PyroModule | None = None):
        super().__init__()
        self.head = mlp(in_dim, hidden, num_features, depth)
        self.gate = GATES[estimator]
        self.num_rows = num_rows
        self.register_buffer("temperature", torch.tensor(float(temperature)))
        self.logit_bound, self.kl_weight = logit_bound, kl_weight
        self.rate_guide = rate_guide

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Gate logits (R x K) from backbone features h (R x D); the head never trains the backbone."""
        b = self.logit_bound
        return b * torch.tanh(self.head(h.detach()) / b)

    def forward(self, z: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Samples the gates (and the prior's global latents); returns the logits, for monitoring."""
        with poutine.scale(scale=self.kl_weight):
            if self.rate_guide is not None:
                self.rate_guide()
            logits = self.logits(h)
            with rows_plate(self.num_rows, h.shape[0], h.device):
                pyro.sample("g", self.gate(self.temperature, logits=logits).to_event(1))
        return logits
