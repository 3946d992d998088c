"""The amortized guide q(g | x): a gating head on detached backbone features -> per-row gate distributions.

Every gate estimator is a :class:`Gate`: a ``Bernoulli`` whose probability is the gate's true inclusion
probability P(g = 1 | x) under that estimator, and whose ``rsample`` is the value the estimator trains
with. So for every estimator ``probs`` is what the KL, the logs, ``gate_probs``, the evaluation mask (its mode,
``mask()``) and ``gates.nc`` read, and ``sample()`` draws from q(g | x) (the posterior draws of ``gates.nc``);
``gs-reference-kl`` alone takes its KL and its evaluation mask at sigmoid(l), as the reference does:

===================  ====================================  ==================================================
name                 P(g = 1 | x)                          what training uses (``rsample``)
===================  ====================================  ==================================================
``ste``              sigmoid(l)                            the reference's deterministic surrogate: the mode
                                                           1[sigmoid(l) > 0.5] forward, identity to sigmoid(l)
                                                           backward; InfoNCE is taken at the mode, not
                                                           averaged over q (the paper's "BayesNCL (STE)")
``relaxed``          sigmoid(l)                            a sampled gate: a hard draw of the binary Concrete
                                                           (on with probability sigmoid(l) at any
                                                           temperature), its relaxation's gradient backward
``gs``               1 + 1e-4 - exp(1e-4 - e^l)            the reference's Gumbel-sigmoid draw: on iff
                     (clamped to [0, 1])                   l + G > 0 with one Gumbel-like G, straight-through
``gs-reference-kl``  as ``gs``                             as ``gs``, but the KL is computed at sigmoid(l),
                                                           not at the gate's inclusion probability: the
                                                           reference's own GS loss, kept for parity (and
                                                           evaluated at its mask, 1[sigmoid(l) > 0.5])
===================  ====================================  ==================================================

(l: the head's logits.) The ``gs`` probability is exact: with G = -log(-log(u + 1e-4) + 1e-4), u ~ U(0, 1),
the gate is on iff u > exp(1e-4 - e^l) - 1e-4. It is 0.632 at l = 0 (sigmoid: 0.5) and exactly 1 for
l > log(1e-4 - log 1e-4) = 2.2204: the 1e-4 inside the log bounds G below by -2.2204, so such a gate is
always on and its KL has no gradient left. Against the plain Gumbel's 1 - exp(-e^l) it differs by at most
1e-4; over every float32 value ``torch.rand`` can return it matches the frequency to 1e-7.

The KL against the prior's ``Bernoulli`` is registered for :class:`Gate` only (never for Pyro's own
classes): :func:`bayesncl_pyro.losses.bernoulli_kl` with the guide's ``kl_clamp`` (0.01 as the reference,
0 for the exact KL). Being a ``Bernoulli`` with ``has_rsample = True`` is what keeps the ELBO bookkeeping
right for every estimator, the deterministic ``ste`` included: ``TraceMeanField_ELBO`` takes the site as
reparameterised (pathwise gradients, no score-function term), subtracts the registered analytic KL of the
Bernoulli q scaled by the guide site's scale (lambda times the plate's scaling, in model and guide alike),
and replays the ``rsample`` value into the model, where InfoNCE sees it. A ``Delta`` at the mode would
instead give KL = -log p(mode), and a plain ``Bernoulli`` (no rsample) a score-function estimator.
"""

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.nn import PyroModule

from bayesncl_pyro.encoders import mlp
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.losses import REFERENCE_KL_CLAMP, bernoulli_kl
from bayesncl_pyro.models.bayesncl import rows_plate
from bayesncl_pyro.plugins import Registry

GATES: Registry = Registry()  # the one home of the estimator names (``--gate``): config, run_svi and compare read it
register = GATES.register


def gate_class(name: str) -> type["Gate"]:
    if name not in GATES:
        raise UserError(f"unknown gate estimator {name!r}; choose one of: {', '.join(GATES)}")
    return GATES[name]


class Gate(dist.Bernoulli):
    """q(g | x) = Bernoulli(P(g = 1 | x)) of one estimator; ``rsample`` is the value it trains with.

    Args:
        logits: the gating head's logits l (any shape); each subclass says how they set P(g = 1).
        temperature: of the relaxation (``relaxed``, ``gs``); the threshold at 0.5 makes P(g = 1) independent of it.
        kl_clamp: both rates of the KL are clamped to [kl_clamp, 1 - kl_clamp] (0 = exact).
    """

    has_rsample = True  # pathwise: the ELBO differentiates through rsample, with no score-function term
    name: str

    def __init__(self, logits: torch.Tensor, temperature: torch.Tensor | float = 1.0,
                 kl_clamp: float = REFERENCE_KL_CLAMP, validate_args=None):
        self.head_logits = logits
        self.temperature = torch.as_tensor(temperature, dtype=logits.dtype, device=logits.device)
        self.kl_clamp = kl_clamp
        super().__init__(probs=self.inclusion(logits), validate_args=validate_args)

    @staticmethod
    def inclusion(logits: torch.Tensor) -> torch.Tensor:
        """P(g = 1) as a function of the head's logits."""
        return logits.sigmoid()

    def kl_probs(self) -> torch.Tensor:
        """The inclusion probability the KL term is computed at: q's own."""
        return self.probs

    kl_name = "KL(q(g | x) || p(g))"  # what kl_probs makes of the KL term, in words

    @classmethod
    def kl_label(cls, kl_clamp: float) -> str:
        """What this estimator's KL term computes, in words (plot titles, logs)."""
        clamp = f", rates clamped to [{kl_clamp:g}, {1 - kl_clamp:g}]" if kl_clamp else ""
        return f"{cls.kl_name}{clamp}"

    def mask(self) -> torch.Tensor:
        """The 0/1 gates the evaluation uses (the representation F, eval.json's ``gates_open``): the posterior mode
        1[P(g = 1 | x) > 0.5]."""
        return (self.probs > 0.5).to(self.probs)

    def expand(self, batch_shape, _instance=None):
        new = self._get_checked_instance(type(self), _instance)
        new.head_logits = self.head_logits.expand(batch_shape)
        new.temperature, new.kl_clamp = self.temperature, self.kl_clamp
        return super().expand(batch_shape, _instance=new)


@register("relaxed")
class RelaxedGate(Gate):
    """A sampled gate: the hard draw of Pyro's ``RelaxedBernoulliStraightThrough`` (on with probability
    sigmoid(l) at any temperature), backward through its relaxed draw."""

    def rsample(self, sample_shape=torch.Size()):
        relaxed = dist.RelaxedBernoulliStraightThrough(self.temperature, logits=self.head_logits)
        return relaxed.rsample(sample_shape)


@register("ste")
class ThresholdGate(Gate):
    """The reference's STE gate: the mode 1[alpha > 0.5] forward, identity to alpha = sigmoid(l) backward.

    Deterministic: training takes InfoNCE at the mode of q (the reference's surrogate, not E_q[InfoNCE]);
    ``sample()`` still draws from q = Bernoulli(alpha)."""

    def rsample(self, sample_shape=torch.Size()):
        alpha = self.probs.expand(self._extended_shape(sample_shape))
        return (alpha > 0.5).to(alpha) + (alpha - alpha.detach())  # exact 0/1 values


@register("gs")
class GumbelSigmoidGate(Gate):
    """The reference's Gumbel-sigmoid gate: y = sigmoid((l + G) / T) with one Gumbel-like
    G = -log(-log(u + 1e-4) + 1e-4) (not the logistic noise of the binary Concrete), thresholded at 0.5,
    straight-through to y. On with probability 1 + 1e-4 - exp(1e-4 - e^l) (module docstring)."""

    EPS = 1e-4  # the reference's two offsets inside the Gumbel transform

    @staticmethod
    def inclusion(logits):
        eps = GumbelSigmoidGate.EPS
        # on iff u > exp(eps - e^l) - eps, u ~ U(0, 1); expm1 keeps the small probabilities precise
        return (eps - torch.expm1(eps - logits.exp())).clamp(0.0, 1.0)

    def rsample(self, sample_shape=torch.Size()):
        logits = self.head_logits.expand(self._extended_shape(sample_shape))
        u = torch.rand_like(logits)
        y = torch.sigmoid((logits - (-(u + self.EPS).log() + self.EPS).log()) / self.temperature)
        return (y > 0.5).to(y) + (y - y.detach())


@register("gs-reference-kl")
class GumbelSigmoidReferenceKLGate(GumbelSigmoidGate):
    """The reference's whole GS loss: the ``gs`` gate, with the KL computed at sigmoid(l) as the reference
    computes it. sigmoid(l) is not this gate's inclusion probability (0.5 against 0.632 at l = 0), so the KL
    term is not KL(q || p); ``probs``, the logs and the posterior still report the true probability. Its
    evaluation mask is the reference's too, 1[sigmoid(l) > 0.5], not the mode of q (1[P(g = 1) > 0.5], which
    opens every gate with l > -0.367)."""

    def kl_probs(self):
        return self.head_logits.sigmoid()

    kl_name = "the reference's KL at sigmoid(l) (not KL(q || p))"

    def mask(self):
        return (self.kl_probs() > 0.5).to(self.probs)


@torch.distributions.kl.register_kl(Gate, torch.distributions.Bernoulli)
def _kl_gate_bernoulli(q, p):
    """KL of the *discrete* gate: the estimator only shapes the training value, the gate is Bernoulli."""
    return bernoulli_kl(q.kl_probs(), p.probs, q.kl_clamp)


class GateGuide(PyroModule):
    """q(rate) q(g | h): the prior's own posterior for global latents (if any) and amortized gates.

    Args:
        in_dim: backbone feature width; hidden, depth: gating-head MLP shape; num_features: K.
        num_rows: rows in the whole training set (2 per image), for minibatch scaling.
        estimator: a name in :data:`GATES`; temperature: the relaxation temperature.
        logit_bound: logits are squashed smoothly into (-bound, bound): a saturated gate would get no
            gradient and never come back.
        kl_weight: lambda, applied here and in the model (TraceMeanField scales the KL by the guide's scale).
        kl_clamp: the KL's rates are clamped to [kl_clamp, 1 - kl_clamp]; 0.01 as the reference, 0 = exact.
        rate_guide: the prior's variational posterior for its global latents, or None.
    """

    def __init__(self, in_dim: int, hidden: int, num_features: int, num_rows: int, *, depth: int = 2,
                 estimator: str = "relaxed", temperature: float = 1.0, logit_bound: float = 5.0,
                 kl_weight: float = 3e-5, kl_clamp: float = REFERENCE_KL_CLAMP,
                 rate_guide: PyroModule | None = None):
        super().__init__()
        self.head = mlp(in_dim, hidden, num_features, depth)
        self.gate = gate_class(estimator)
        self.num_rows = num_rows
        self.register_buffer("temperature", torch.tensor(float(temperature)))
        self.logit_bound, self.kl_weight, self.kl_clamp = logit_bound, kl_weight, kl_clamp
        self.rate_guide = rate_guide

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Gate logits (R x K) from backbone features h (R x D); the head never trains the backbone."""
        b = self.logit_bound
        return b * torch.tanh(self.head(h.detach()) / b)

    def posterior(self, h: torch.Tensor) -> Gate:
        """q(g | x) for backbone features h (R x D): ``.probs`` the inclusion probabilities, ``.sample()`` draws."""
        return self.gate(self.logits(h), self.temperature, self.kl_clamp)

    def inclusion_probs(self, h: torch.Tensor) -> torch.Tensor:
        """The true inclusion probabilities q(g_k = 1 | x) under this guide's estimator, R x K."""
        return self.gate.inclusion(self.logits(h))

    def forward(self, z: torch.Tensor, h: torch.Tensor) -> Gate:
        """Samples the gates (and the prior's global latents); returns q(g | x), the :class:`Gate` the site
        sampled from (``probs``, ``kl_probs()``), for monitoring.

        The site's value is the gate's ``rsample``, the value training uses, because the gate declares itself
        reparameterised: for ``ste`` that is the mode, 1[sigmoid(l) > 0.5], every time. So anything that draws
        through Pyro's sample statements (``pyro.infer.Predictive``, ``poutine.trace(guide)``) gets modes for
        ``ste``, not draws from q. Draws from q(g | x) come from ``self.posterior(h).sample()`` (what
        ``posterior.gate_posterior(..., num_draws=S)`` and ``gates.nc`` use)."""
        with poutine.scale(scale=self.kl_weight):
            if self.rate_guide is not None:
                self.rate_guide()
            q = self.posterior(h)
            with rows_plate(self.num_rows, h.shape[0], h.device):
                pyro.sample("g", q.to_event(1))
        return q
