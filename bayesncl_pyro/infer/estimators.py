"""How training differentiates through the gates: the estimators of ``--gate``, on the inference side.

The program says what is random: the guide draws hard gates g from q(g | x), a product of Bernoullis
(``guides/gates.py``), and the model's InfoNCE factor reads them (``models/bayesncl.py``). As written, the
gate site is discrete, so Pyro differentiates it by the score function (unbiased, but one scalar weights
every gate of the batch: its signal falls as 1 / sqrt(gates)). Training instead runs the guide under
``poutine.reparam(config={"g": estimator})`` with one of the estimators below, each a
:class:`pyro.infer.reparam.Reparam` that sets the site's value, the gates InfoNCE sees, together with the
gradient path that value carries, and keeps q as the site's distribution; and the ELBO it trains with, which takes
the site's KL as the estimator trains it. The program is the same for every estimator; only inference changes.
(As Pyro's own reparameterisers keep the site's distribution; but ``ste``'s value is no draw of it: it is the
reference's surrogate, and says so.)

=====================  ===========================  ============================================  ==================
name                   q(g | x) (the guide's)       the gates' value in training                  its head gradient
=====================  ===========================  ============================================  ==================
``ste``                Bernoulli(sigmoid(l))        the mode 1[p > 0.5], identity to p backward:  a straight-through
                                                    InfoNCE at the mode, not averaged over q      pseudo-gradient of
                                                                                                  the reference's
                                                                                                  surrogate, not the
                                                                                                  ELBO's
``relaxed``            Bernoulli(sigmoid(l))        a draw, the binary Concrete's gradient        the ELBO's, biased
                                                    (q's ``rsample``)
``st-sampled``         Bernoulli(sigmoid(l))        a draw b, straight-through: b + p - sg(p)     the ELBO's, biased
``leg``                Bernoulli(sigmoid(l))        a draw b; per gate, the exact difference of   the ELBO's,
                                                    the batch's InfoNCE with it on and off        unbiased
``gs``                 the reference's Gumbel-      its Gumbel-sigmoid draw, straight-through     its ELBO's, biased
                       sigmoid family               (q's ``rsample``)
``gs-reference-kl``    as ``gs``                    as ``gs``; its KL taken at sigmoid(l), which  of the reference's
                                                    is not q's P(on): the reference's GS loss     GS loss (biased)
=====================  ===========================  ============================================  ==================

(p = P(g = 1 | x), l the head's logits, sg: stop-gradient; "the ELBO" is the training objective, -ELBO / 2N
with the KL clamped as ``--kl-clamp`` says, the exact KL at 0.) Why each is what the table says, with q a
product of Bernoullis and L(g) the batch's summed InfoNCE:

* the head gradient of E_q[L] is sum_ik dp_ik/dphi * E_q[D_ik], D_ik = L(g, g_ik = 1) - L(g, g_ik = 0), which
  does not depend on g_ik itself (the KL's gradient is exact for every estimator and comes on top). ``leg``
  (local expectation gradients, Titsias & Lazaro-Gredilla 2015) computes D_ik exactly at one draw of the
  other gates (:func:`bayesncl_pyro.nn.losses.info_nce_flip_differences`, all R K of them in O(R^2 K)), so its
  head gradient is unbiased; the projector's is pathwise at the same draw, also unbiased (q does not depend on
  it). The backbone's is the pathwise gradient with q held fixed, as for every estimator: the gating head
  reads h.detach(), as the reference's does.
* ``st-sampled`` puts the local derivative dL/dg_ik at the draw in place of D_ik (equal only where L is
  linear in the gate); ``relaxed`` the same local derivative at its hard draw, weighted by the relaxation's
  dy/dl instead of dp/dl, which for a loss linear in the gate is E[sigma'(l + L)] / sigma'(l) of the true
  slope at temperature 1 for logistic noise L (2/3 at l = 0); ``gs``'s straight-through weight, likewise, is
  0.52 of the true dP/dl at l = 0, 0.84 at l = 1 and 19.4 at l = 2, and past l = 2.22, where P = 1 and the
  true slope is 0, it still pushes.
* ``ste`` takes InfoNCE at the mode of q, the reference's deterministic surrogate, piecewise constant in l: its
  straight-through gradient is no gradient of any objective, the cost of the gates' randomness never reaches
  the head, and the loss it reports is "InfoNCE at the mode + lambda KL", not -ELBO.

``docs/RESULTS.md`` measures each against the unbiased gradient (``experiments/gate_gradient_bias.py``).

``leg`` alone needs more than its value: its head gradient comes from the likelihood's per-gate differences,
which need the downstream cost, so it belongs to inference's other half, the ELBO: each estimator names the ELBO
it trains with (:meth:`GateEstimator.elbo`), the mean-field ELBO for all but ``leg``, whose
:class:`LocalExpectationELBO` adds that gradient as a term of value 0. Pyro's own ELBOs on the reparameterised
program train leg's gating head on the KL only.

Every estimator trains with the KL clamped as the reference clamps it (``kl_clamp``: both rates in
[c, 1 - c]; 0 gives the exact KL). The clamp is its ELBO's argument (``MeanFieldELBO(kl_clamp=...)``), not the
site's: the reparam keeps q as the site's distribution and sets its value only.
"""

import copy

import torch
from pyro.infer.reparam.reparam import Reparam

from bayesncl_pyro.errors import UserError
from bayesncl_pyro.guides.gates import BernoulliGates, GumbelSigmoidGates
from bayesncl_pyro.infer.elbo import MeanFieldELBO
from bayesncl_pyro.models.bayesncl import gate_site, likelihood_site
from bayesncl_pyro.nn.losses import REFERENCE_KL_CLAMP, info_nce_flip_differences
from bayesncl_pyro.plugins import Registry

GATES: Registry = Registry()  # the one home of the estimator names (``--gate``): config, run_svi and compare read it
register = GATES.register


def gate_class(name: str) -> type["GateEstimator"]:
    """The estimator class registered as ``name``, or one clear error."""
    if name not in GATES:
        raise UserError(f"unknown gate estimator {name!r}; choose one of: {', '.join(GATES)}")
    return GATES[name]


class GateEstimator(Reparam):
    """One way of differentiating through the gate site, with the ELBO it trains with.

    ``apply`` gives the site its training value (a reparam that sets the site's value and nothing else); ``elbo`` is
    the ELBO it trains with, which takes the KL as this estimator trains it: clamped, at :meth:`kl_probs`.

    Args:
        kl_clamp: the KL's rates are clamped to [kl_clamp, 1 - kl_clamp] by its ELBO; 0.01 as the reference, 0 =
            exact.
    """

    name: str
    family: type[BernoulliGates] = BernoulliGates  # the variational family it trains: the guide's distribution
    unbiased = False  # whether its gradient is an unbiased estimate of the ELBO's (lambda * clamped KL included)
    # what the loss that training reports (the log's "loss", "nce") computes, in words
    objective = "-ELBO per row: E_q[InfoNCE] (one draw of q) + lambda * KL"
    loss_name = "-ELBO per row"  # the same, in a plot title's few words
    kl_name = "KL(q(g | x) || p(g)) at q's inclusion probabilities"  # what its KL term computes

    def __init__(self, kl_clamp: float = REFERENCE_KL_CLAMP):
        self.kl_clamp = kl_clamp

    def value(self, q: BernoulliGates) -> torch.Tensor:
        """The gates InfoNCE sees in training, with the gradient they carry to q's parameters.

        Args:
            q: the guide's gate distribution at the site.

        Returns:
            The gates, q's shape, exact 0/1 values (its own estimator's gradient path attached).
        """
        raise NotImplementedError

    def kl_probs(self, q: BernoulliGates) -> torch.Tensor:
        """The inclusion probabilities its KL term is taken at: q's own."""
        return q.probs

    def mask_probs(self, q: BernoulliGates) -> torch.Tensor:
        """The probabilities whose threshold at 1/2 is :meth:`mask` (q's own): a density target's gradient follows."""
        return q.probs

    def mask(self, q: BernoulliGates) -> torch.Tensor:
        """The 0/1 gates of the evaluation (the representation F, eval.json's ``gates_open``): q's mode."""
        return q.mode

    def elbo(self) -> MeanFieldELBO:
        """The ELBO that trains with this estimator.

        The mean-field ELBO with this estimator's KL (clamped at ``kl_clamp``, taken at :meth:`kl_probs`), the
        estimator's gradient carried by the gates' value; ``leg`` adds its head gradient there.
        """
        return MeanFieldELBO(kl_clamp=self.kl_clamp, kl_probs=self.kl_probs)

    @classmethod
    def kl_label(cls, kl_clamp: float) -> str:
        """What this estimator's KL term computes, in words (plot titles, logs)."""
        clamp = f", rates clamped to [{kl_clamp:g}, {1 - kl_clamp:g}]" if kl_clamp else ""
        return f"{cls.kl_name}{clamp}"

    def apply(self, msg):
        """Set the gate site's value to :meth:`value` of q; an observed site is left as it is."""
        if msg["is_observed"]:  # a conditioned site has its value: nothing to estimate
            return {"fn": msg["fn"], "value": msg["value"], "is_observed": True}
        fn, event_dim = self._unwrap(msg["fn"])
        if not isinstance(fn, self.family):
            raise UserError(f"the {self.name} estimator trains a {self.family.__name__} gate site, but site "
                            f"{msg['name']!r} draws from a {type(fn).__name__}; build the guide with "
                            f"family={self.family.__name__}")
        # the site keeps q (a copy of this call's, so the guide's own q is left as it is), pathwise: an ELBO takes no
        # score-function term for it, and the gradient through the gates is the value's
        pathwise = copy.copy(fn).has_rsample_(True)
        return {"fn": self._wrap(pathwise, event_dim), "value": self.value(fn), "is_observed": False}


@register("ste")
class ModeStraightThrough(GateEstimator):
    """The reference's STE: the mode of q forward, straight-through to p backward.

    The mode is 1[p > 0.5], and the backward pass is the identity to p. Deterministic: InfoNCE is taken at the mode
    of q, not averaged over it (the paper's "BayesNCL (STE)").

    Args:
        kl_clamp: the KL's clamp, as :class:`GateEstimator`'s.
    """

    objective = "the reference's surrogate: InfoNCE at the mode of q + lambda * KL (not -ELBO)"
    loss_name = "the reference's surrogate per row (not -ELBO)"

    def value(self, q):
        """The mode 1[p > 0.5], straight-through to p.

        Args:
            q: the guide's gate distribution at the site.

        Returns:
            1[p > 0.5] + p - sg(p): the mode forward, the identity to p backward.
        """
        p = q.probs
        return q.mode + (p - p.detach())  # exact 0/1 values: (p - p.detach()) is exactly 0


@register("relaxed")
class Relaxed(GateEstimator):
    """A draw from q, differentiated through its relaxation.

    It is q's own ``rsample`` (for ``BernoulliGates``, Pyro's ``RelaxedBernoulliStraightThrough``).

    Args:
        kl_clamp: the KL's clamp, as :class:`GateEstimator`'s.
    """

    def value(self, q):
        """The relaxed draw of q.

        Args:
            q: the guide's gate distribution at the site.

        Returns:
            q's ``rsample``: a hard draw, its relaxation's gradient backward.
        """
        return q.rsample()


@register("st-sampled")
class SampledStraightThrough(GateEstimator):
    """A draw from q forward, straight-through to p backward.

    A draw b ~ q forward, straight-through to p backward (b + p - sg(p)): the local derivative of InfoNCE at
    the draw stands in for the gate's exact effect. Costs nothing over ``ste``.

    Args:
        kl_clamp: the KL's clamp, as :class:`GateEstimator`'s.
    """

    def value(self, q):
        """A draw b ~ q, straight-through to p.

        Args:
            q: the guide's gate distribution at the site.

        Returns:
            b + p - sg(p): the draw forward, the identity to p backward.
        """
        p = q.probs
        return q.sample() + (p - p.detach())


class Draw(GateEstimator):
    """A draw from q with no gradient through it: for evaluation, and leg's value.

    Evaluating the objective needs it (``BayesNCLHead.objective_draw``). Not a training estimator by itself.
    """

    def value(self, q):
        """A draw b ~ q, no gradient."""
        return q.sample()


@register("leg")
class LocalExpectation(Draw):
    """Local expectation gradients: unbiased for the training objective's gradient.

    A draw b ~ q forward, the encoder's gradient pathwise at b, and for the gating head, per gate, the exact
    difference of the batch's InfoNCE with that gate on and off at the other gates' draw (its ELBO,
    :class:`LocalExpectationELBO`). Why it is unbiased: the module docstring.

    Args:
        kl_clamp: the KL's clamp, as :class:`GateEstimator`'s.
    """

    unbiased = True

    def elbo(self):
        """The mean-field ELBO with leg's head gradient."""
        return LocalExpectationELBO(kl_clamp=self.kl_clamp, kl_probs=self.kl_probs)


class LocalExpectationELBO(MeanFieldELBO):
    """The mean-field ELBO with ``leg``'s head gradient added.

    The gates' value is a draw with no gradient path, so the traces alone train the gating head on the KL only; this
    adds, per particle, the InfoNCE factor's local expectation gradient as a term of value 0, scaled as the factor
    is:

        sum_ik (p_ik - sg(p_ik)) * sg(D_ik),   D = ``info_nce_flip_differences(ungated, g)``,

    whose gradient with respect to q's parameters is sum_ik D_ik dp_ik, the local expectation gradient of the
    batch's summed InfoNCE (module docstring). It finds in the traces what the program marks, not sites by name:
    the gate site (``models.bayesncl.gate_site``: the draw from the model's trace, q's probabilities from the guide's
    site of that name) and the InfoNCE factor (``models.bayesncl.likelihood_site``: the features it gates, its
    temperature and its scale). The probabilities enter through a node of their own, which it returns as the
    particle's ``gate_probs``: its gradient after backward is InfoNCE's alone (the KL's reaches q through another
    path).

    Args:
        kl_clamp: as :class:`MeanFieldELBO`'s: the gate KL's clamp (None: each site's registered KL).
        kl_probs: as :class:`MeanFieldELBO`'s: q's rates the clamped KL is taken at.
        **kwargs: ``TraceMeanField_ELBO``'s (``num_particles``, ...).
    """

    def particle(self, model_trace, guide_trace):
        """The mean-field particle plus :func:`local_expectation_term`, its probabilities node returned.

        Args:
            model_trace: the model's trace, replayed against the guide's.
            guide_trace: the guide's trace.

        Returns:
            The mean-field particle with the term added to its loss and the probabilities node as ``gate_probs``.
        """
        particle = super().particle(model_trace, guide_trace)
        term, probs = local_expectation_term(model_trace, guide_trace)
        return particle._replace(loss=particle.loss + term, gate_probs=probs)


def local_expectation_term(model_trace, guide_trace) -> tuple[torch.Tensor, torch.Tensor]:
    """(:class:`LocalExpectationELBO`'s term for one pair of traces, its node of q's probabilities).

    The term has value 0 and is on the loss's scale.
    """
    gates, factor = gate_site(model_trace), likelihood_site(model_trace)
    probs = guide_trace.nodes[gates["name"]]["fn"].base_dist.probs * 1.0  # a node of its own (LocalExpectationELBO)
    features, temperature = factor["infer"]["info_nce"]["ungated"], factor["infer"]["info_nce"]["temperature"]
    dtype = torch.promote_types(features.dtype, torch.float32)
    d = info_nce_flip_differences(features.to(dtype), gates["value"], temperature).to(probs.dtype)
    return ((probs - probs.detach()) * d).sum() * factor["scale"], probs


@register("gs")
class GumbelSigmoid(Relaxed):
    """The reference's Gumbel-sigmoid gate, straight-through.

    A draw from the reference's own family (P(on) = 1 + 1e-4 - exp(1e-4 - e^l), not sigmoid(l)), straight-through to
    y = sigmoid((l + G) / T).

    Args:
        kl_clamp: the KL's clamp, as :class:`GateEstimator`'s.
    """

    family = GumbelSigmoidGates


@register("gs-reference-kl")
class GumbelSigmoidReferenceKL(GumbelSigmoid):
    """The reference's whole GS loss: the ``gs`` gate with the KL at sigmoid(l).

    The KL is computed at sigmoid(l) as the reference computes it. sigmoid(l) is not this family's inclusion probability
    (0.5 against 0.632 at l = 0), so the KL term is not KL(q || p) and the loss is no ELBO; the logs and the posterior
    still report q's probability. Its evaluation mask is the reference's too, 1[sigmoid(l) > 0.5], not q's mode
    (1[P(g = 1) > 0.5], which opens every gate with l > -0.367).
    """

    objective = "the reference's GS loss: InfoNCE at one Gumbel-sigmoid draw + lambda * KL at sigmoid(l) (not -ELBO)"
    loss_name = "the reference's GS loss per row (not -ELBO)"
    kl_name = "the reference's KL at sigmoid(l) (not KL(q || p))"

    def kl_probs(self, q):
        """sigmoid(l), as the reference's KL."""
        return q.head_logits.sigmoid()

    def mask_probs(self, q):
        """sigmoid(l), which the reference's mask thresholds."""
        return q.head_logits.sigmoid()

    def mask(self, q):
        """The reference's mask, 1[sigmoid(l) > 0.5]."""
        return (self.mask_probs(q) > 0.5).to(q.probs)
