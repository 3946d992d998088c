"""The amortized guide q(g | x): a gating head on detached backbone features -> per-row gate distributions.

The guide says what q is, not how training differentiates through it: its site ``g`` draws hard 0/1 gates
from one of two variational families, and the gradient estimator (``--gate``) is applied by the inference
side (``bayesncl_pyro/infer/estimators.py``). Both families are Bernoulli distributions whose ``sample`` draws,
``log_prob``, ``entropy``, ``enumerate_support`` and KL are the Bernoulli's, with one reparameterised draw
attached as ``rsample`` (hard values, a relaxed gradient):

===========================  ==============================  ===================================================
family                       P(g = 1 | x)                    ``rsample``: its straight-through draw
===========================  ==============================  ===================================================
:class:`BernoulliGates`      sigmoid(l)                      Pyro's ``RelaxedBernoulliStraightThrough`` with the
                                                             head's logits: the binary Concrete's draw, hard
                                                             forward (on with probability sigmoid(l) at any
                                                             temperature), its relaxation's gradient backward
:class:`GumbelSigmoidGates`  1 + 1e-4 - exp(1e-4 - e^l)      the reference's Gumbel-sigmoid draw: on iff
                             (clamped to [0, 1])             l + G > 0 with one Gumbel-like G, straight-through
                                                             to sigmoid((l + G) / T)
===========================  ==============================  ===================================================

(l: the head's logits.) Why not Pyro's ``RelaxedBernoulliStraightThrough`` itself: its draws are hard, but
its ``log_prob`` is the relaxed density of the unquantised draw and its ``sample()`` returns soft values, so
for a model whose gates are Bernoulli (``models/bayesncl.py``) it is not q: ``Trace_ELBO`` would mix that
density with a Bernoulli mass. These families keep its ``rsample`` and are Bernoullis otherwise.

``has_rsample`` is False: the gates are discrete, so the program as written is differentiated the way Pyro
differentiates a discrete site, by the score function (``TraceGraph_ELBO`` on it is unbiased);
``pyro.infer.Predictive`` (sequential: InfoNCE is not batched over draws) and ``poutine.trace(guide)`` get real
draws from q. Pyro's ``has_rsample_(True)`` turns a site pathwise (its ``rsample``), which is the ``relaxed`` and
``gs`` estimators; the others set the site's value themselves.

The ``gs`` probability is exact: with G = -log(-log(u + 1e-4) + 1e-4), u ~ U(0, 1), the gate is on iff
u > exp(1e-4 - e^l) - 1e-4. It is 0.632 at l = 0 (sigmoid: 0.5) and exactly 1 for l > log(1e-4 - log 1e-4)
= 2.2204: the 1e-4 inside the log bounds G below by -2.2204, so such a gate is always on and its KL has no
gradient left. Against the plain Gumbel's 1 - exp(-e^l) it differs by at most 1e-4; over every float32 value
``torch.rand`` can return it matches the frequency to 1e-7.
"""

import pyro
import pyro.distributions as dist
import torch
from pyro import poutine
from pyro.infer import Predictive
from pyro.infer.autoguide import AutoNormal
from pyro.infer.autoguide.initialization import init_to_sample
from pyro.nn import PyroModule, PyroSample
from pyro.nn.module import to_pyro_module_
from torch import nn

from bayesncl_pyro.models.bayesncl import image_features, images_plate, rows_plate, scaled_call
from bayesncl_pyro.nn.encoders import mlp
from bayesncl_pyro.nn.losses import bound_logits


class BernoulliGates(dist.Bernoulli):
    """q(g | x) = Bernoulli(sigmoid(l)), with the binary Concrete's straight-through draw as ``rsample``.

    Args:
        logits: the gating head's logits l (any shape).
        temperature: of the relaxation (``rsample``'s gradient only: the hard draw is on with probability
            sigmoid(l) at any temperature).
        validate_args: torch's check of the arguments (default: torch's setting).
    """

    has_rsample = False  # discrete: Pyro's ELBOs take the score function unless an estimator says otherwise

    def __init__(self, logits: torch.Tensor, temperature: torch.Tensor | float = 1.0, validate_args=None):
        self.head_logits = logits
        self.temperature = torch.as_tensor(temperature, dtype=logits.dtype, device=logits.device)
        super().__init__(probs=self.inclusion(logits), validate_args=validate_args)

    @staticmethod
    def inclusion(logits: torch.Tensor) -> torch.Tensor:
        """P(g = 1) as a function of the head's logits."""
        return logits.sigmoid()

    @property
    def mode(self) -> torch.Tensor:
        """1[P(g = 1) > 0.5]: the evaluation mask (a gate at exactly 0.5 is closed, where torch's mode is NaN)."""
        return (self.probs > 0.5).to(self.probs)

    def rsample(self, sample_shape=torch.Size()) -> torch.Tensor:
        """A hard draw (exact 0/1, on with probability P(g = 1)) whose gradient is its relaxation's."""
        return dist.RelaxedBernoulliStraightThrough(self.temperature, logits=self.head_logits).rsample(sample_shape)

    def expand(self, batch_shape, _instance=None):
        """The same family expanded to ``batch_shape``, its logits and temperature kept."""
        new = self._get_checked_instance(type(self), _instance)
        new.head_logits = self.head_logits.expand(batch_shape)
        new.temperature = self.temperature
        return super().expand(batch_shape, _instance=new)


class GumbelSigmoidGates(BernoulliGates):
    """The reference's GS family: on iff l + G > 0, G a Gumbel draw.

    Here G = -log(-log(u + 1e-4) + 1e-4), u ~ U(0, 1); P(g = 1) = 1 + 1e-4 - exp(1e-4 - e^l) (module docstring), not
    sigmoid(l). ``rsample`` is the reference's draw, straight-through to y = sigmoid((l + G) / T).

    Args:
        logits: the gating head's logits l (any shape).
        temperature: T of the straight-through gradient (the hard draw does not depend on it).
        validate_args: torch's check of the arguments (default: torch's setting).
    """

    EPS = 1e-4  # the reference's two offsets inside the Gumbel transform

    @staticmethod
    def inclusion(logits):
        """P(g = 1) of the reference's Gumbel gate at logits l.

        Args:
            logits: l (any shape).

        Returns:
            1 + 1e-4 - exp(1e-4 - e^l), clamped to [0, 1], ``logits``' shape.
        """
        eps = GumbelSigmoidGates.EPS
        # on iff u > exp(eps - e^l) - eps; expm1 keeps the small probabilities precise
        return (eps - torch.expm1(eps - logits.exp())).clamp(0.0, 1.0)

    def rsample(self, sample_shape=torch.Size()):
        """The reference's draw, straight-through to sigmoid((l + G) / T)."""
        logits = self.head_logits.expand(self._extended_shape(sample_shape))
        u = torch.rand_like(logits)
        y = torch.sigmoid((logits - (-(u + self.EPS).log() + self.EPS).log()) / self.temperature)
        return (y > 0.5).to(y) + (y - y.detach())  # exact 0/1 values


GATE_HEADS = ("mlp", "bayesian")
"""The gating heads: ``mlp``, weights as point estimates (the reference's); ``bayesian``, :class:`BayesianHead`."""


class BayesianHead(PyroModule):
    """The gating MLP with latent weights: a prior p(W) on each layer's weights and biases, q(W) mean-field Normal.

    The prior is ``PyroSample(Normal(0, 1 / sqrt(fan_in)))`` on every weight and bias (the scale of PyTorch's default
    initialisation); the posterior is Pyro's ``AutoNormal`` over those sites (:attr:`q`), whose locations start at a
    draw from the prior and whose scales start at ``init_scale``. The model samples W from :meth:`prior` (under the
    same lambda as the gates: lambda is the temperature of the Gibbs posterior, ``models/bayesncl.py``), the guide
    from :attr:`q`, so the ELBO holds KL(q(W) || p(W)) once per data set: per row, lambda * KL / 2N. Each training step
    draws W from q, then the gates from q(g | x, W): q(g | x) is a mixture over W, whose spread across draws
    (:meth:`weight_draws`) is the head's epistemic uncertainty. The evaluation's q(g | x) is at W's posterior mean.

    Args:
        in_dim, hidden, out_dim, depth: the MLP's shape (``nn.encoders.mlp``).
        init_scale: q(W)'s starting standard deviation.
    """

    def __init__(self, in_dim: int, hidden: int, out_dim: int, depth: int = 2, init_scale: float = 0.01):
        super().__init__()
        net = mlp(in_dim, hidden, out_dim, depth)
        to_pyro_module_(net)
        for layer in net:
            if isinstance(layer, nn.Linear):
                scale = layer.in_features ** -0.5
                layer.weight = PyroSample(dist.Normal(0.0, scale).expand(layer.weight.shape).to_event(2))
                layer.bias = PyroSample(dist.Normal(0.0, scale).expand(layer.bias.shape).to_event(1))
        self.net = net
        self.q = AutoNormal(self.prior, init_loc_fn=init_to_sample, init_scale=init_scale)

    def _linears(self):
        return [layer for layer in self.net if isinstance(layer, nn.Linear)]

    def prior(self):
        """The model's statement of W ~ p(W): each weight and bias sampled from its prior.

        Returns:
            Each linear layer's (weight, bias), as drawn (or replayed) at their sample sites.
        """
        with self._pyro_context:  # a PyroSample attribute is a sample site only inside its module's context
            return [(layer.weight, layer.bias) for layer in self._linears()]

    def forward(self, h: torch.Tensor, weights: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The MLP's output at ``weights`` (site name -> value), by default a draw from :attr:`q` (its sites traced)."""
        weights = self.q() if weights is None else weights
        with poutine.block(), poutine.condition(data=weights):
            return self.net(h)

    def mean_weights(self) -> dict[str, torch.Tensor]:
        """W at q's mean (its location): the evaluation's point."""
        return self.q.median()

    @torch.no_grad()
    def weight_draws(self, num_draws: int) -> dict[str, torch.Tensor]:
        """``num_draws`` draws of W from q (``pyro.infer.Predictive``): site name -> S x shape."""
        return Predictive(self.prior, guide=self.q, num_samples=num_draws, return_sites=list(self.mean_weights()))()


class GateGuide(PyroModule):
    """q(rate) q(g | h): the prior's own posterior for global latents (if any) and amortized gates.

    Args:
        in_dim: backbone feature width.
        hidden: the gating-head MLP's hidden width.
        num_features: K, the gates per row.
        num_rows: rows in the whole training set (2 per image), for minibatch scaling.
        family: the variational family of the gates, :class:`BernoulliGates` or :class:`GumbelSigmoidGates`
            (the estimator's, ``bayesncl_pyro.infer.estimators``).
        depth: the gating-head MLP's number of layers.
        temperature: the family's relaxation temperature.
        logit_bound: logits are squashed smoothly into (-bound, bound): a saturated gate would get no
            gradient and never come back.
        kl_weight: lambda, applied here and in the model (a mean-field ELBO scales the KL by the guide's scale).
        rate_guide: the prior's variational posterior for its latents, or None.
        row_latents: the prior's ``row_latents``: its guide is called as ``rate_guide(h, plate)``, with each image's
            backbone features (``models.bayesncl.image_features``, from its two views) and the images plate.
        gate_head: ``mlp`` or ``bayesian`` (:class:`BayesianHead`: the model then also samples its weights, through
            :meth:`head_prior`).
    """

    def __init__(self, in_dim: int, hidden: int, num_features: int, num_rows: int, *, depth: int = 2,
                 family: type[BernoulliGates] = BernoulliGates, temperature: float = 1.0, logit_bound: float = 5.0,
                 kl_weight: float = 3e-5, rate_guide: PyroModule | None = None, row_latents: bool = False,
                 gate_head: str = "mlp"):
        super().__init__()
        if gate_head == "bayesian":
            self.head = BayesianHead(in_dim, hidden, num_features, depth)
        else:
            # a PyroModule itself: read here as a plain module, each step would register its parameters in Pyro's
            # param store (pyro.module, a param statement per tensor) for nothing, the caller's optimizer training them
            self.head = mlp(in_dim, hidden, num_features, depth)
            to_pyro_module_(self.head, recurse=False)
        self.family = family
        self.num_rows = num_rows
        self.register_buffer("temperature", torch.tensor(float(temperature)))
        self.logit_bound, self.kl_weight = logit_bound, kl_weight
        self.rate_guide, self.row_latents = rate_guide, row_latents

    @property
    def bayesian(self) -> bool:
        """Whether the gating head's weights are latent (:class:`BayesianHead`)."""
        return isinstance(self.head, BayesianHead)

    def head_prior(self):
        """The model's W ~ p(W) of a Bayesian gating head (nothing for a plain one)."""
        if self.bayesian:
            self.head.prior()

    def logits(self, h: torch.Tensor, mlp_dtype: torch.dtype | None = None, weights="mean") -> torch.Tensor:
        """Gate logits l = b tanh(MLP(sg(h)) / b), b the logit bound: the head never trains the backbone.

        Args:
            h: R x D backbone features, read detached.
            mlp_dtype: None, or the dtype in which the MLP's matmuls run under autocast (the logits and all after
                them in h's dtype): ``BayesNCLHead.forward`` passes its caller's autocast, as the backbone's and
                projector's.
            weights: a Bayesian head's: ``"mean"``, q(W)'s mean; None, a draw from q(W) as a traced site (the
                guide's); or a dict of site values (one of :meth:`BayesianHead.weight_draws`).

        Returns:
            R x K logits, in (-b, b).
        """
        b = self.logit_bound
        if self.bayesian:
            head = lambda x: self.head(x, self.head.mean_weights() if weights == "mean" else weights)  # noqa: E731
        else:
            head = self.head
        if mlp_dtype is None:
            raw = head(h.detach())
        else:
            with torch.autocast(h.device.type, dtype=mlp_dtype):
                raw = head(h.detach()).to(h.dtype)
        return bound_logits(raw, b)

    def posterior(self, h: torch.Tensor, family: type[BernoulliGates] | None = None,
                  mlp_dtype: torch.dtype | None = None, weights="mean") -> BernoulliGates:
        """q(g | x) for backbone features h (R x D).

        Its ``.probs`` are the inclusion probabilities and ``.sample()`` draws; ``family``: another family on the
        same logits (default the guide's); ``mlp_dtype``, ``weights``: :meth:`logits`' (a Bayesian head's q at its
        weights' posterior mean by default).
        """
        return (family or self.family)(self.logits(h, mlp_dtype, weights), self.temperature)

    @torch.no_grad()
    def weight_probs(self, h: torch.Tensor, num_draws: int) -> torch.Tensor:
        """S x R x K: q(g = 1 | x, W) at ``num_draws`` draws of a Bayesian head's weights from q(W)."""
        draws = self.head.weight_draws(num_draws)
        return torch.stack([self.posterior(h, weights={k: v[s] for k, v in draws.items()}).probs
                            for s in range(num_draws)])

    def forward(self, z: torch.Tensor, h: torch.Tensor, kl_weight=None,
                family: type[BernoulliGates] | None = None, mlp_dtype: torch.dtype | None = None,
                prior_grad_scale=None) -> BernoulliGates:
        """Samples the gates (and the prior's latents) from q; returns q(g | x).

        ``kl_weight``: this call's lambda (default: the constructor's); ``family``, ``mlp_dtype``: as
        :meth:`posterior`'s; ``prior_grad_scale``: None, or a factor on the gradient into the prior's guide's parameters
        through this call (``nn.gradient_scale``: the head's 1 / lambda).
        """
        with poutine.scale(scale=self.kl_weight if kl_weight is None else kl_weight):
            plate = rows_plate(self.num_rows, h.shape[0], h.device)
            if self.rate_guide is not None:
                if self.row_latents:  # one latent per image, read from its two views' features
                    scaled_call(self.rate_guide, prior_grad_scale, image_features(h),
                                images_plate(self.num_rows, h.shape[0], h.device))
                else:
                    scaled_call(self.rate_guide, prior_grad_scale)
            q = self.posterior(h, family, mlp_dtype, weights=None)  # a Bayesian head: W drawn from q(W) here
            with plate:
                pyro.sample("g", q.to_event(1))
        return q
