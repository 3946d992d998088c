"""The head's Pyro program: the model and guide of one batch, as written and under a gate estimator, and its ELBO.

:class:`HeadProgram` is a part of ``BayesNCLHead`` (``infer/head.py``), which holds the modules it closes over (the
model, the guide, the estimator, lambda); kept apart because building the program is one idea and training it another.
"""

import pyro
from pyro import poutine

from bayesncl_pyro.infer.elbo import MeanFieldELBO
from bayesncl_pyro.infer.estimators import GateEstimator


def _no_guide(z, h):
    """NCL and CL have no latent variables: the ELBO is the likelihood factor alone."""


class HeadProgram:
    """The program factory of ``BayesNCLHead``: the program, its training form, its ELBO and its SVI form."""

    def program(self, gather=None, kl_weight=None, family=None):
        """The head's Pyro program for one batch, as written: ``(model, guide)``.

        Its gate site is discrete (no gate estimator applied): ``pyro.infer.Predictive`` draws from q, and Pyro's ELBOs
        take the score function through it. The model returns what it computed (``models/bayesncl.py``), which
        :meth:`forward` reads from the trace. Run them inside :func:`own_params`, as :meth:`elbo_terms` does; for Pyro's
        ``SVI``, :meth:`svi_program`.

        Args:
            gather: None to contrast the batch's rows with each other, or ``distributed.gather_rows`` to contrast each
                row against every rank's rows.
            kl_weight: lambda for the KL; None (the default): :attr:`kl_weight`, read when the program runs.
            family: q's family of the gates (``guides.gates.BernoulliGates`` or ``GumbelSigmoidGates``); None (the
                default): the guide's.

        Returns:
            ``(model, guide)``, Pyro callables of (z, h), projector outputs R x K and backbone features R x D; for NCL
            and CL the guide samples nothing.
        """
        return self._program(self.guide, gather, kl_weight, family)

    def training_program(self, estimator: GateEstimator | None = None, gather=None, kl_weight=None, family=None,
                         mlp_dtype=None):
        """:meth:`program` with a gate estimator applied to the guide's gate site.

        This is what training differentiates, with the estimator's ELBO (``GateEstimator.elbo``: its KL clamp, and
        ``leg``'s head gradient, which this program's traces alone lack). The prior's parameters and its guide's get
        their gradient through it divided by lambda (``nn/gradient_scale.py``).

        Args:
            estimator: the gate estimator applied with ``poutine.reparam``; None (the default): the head's.
            gather: as :meth:`program`'s: None, or ``distributed.gather_rows`` for every rank's rows as negatives.
            kl_weight: lambda for the KL; None (the default): :attr:`kl_weight`, read when the program runs.
            family: q's family of the gates; None (the default): the guide's.
            mlp_dtype: the autocast dtype the gating MLP runs under (``GateGuide.logits``); None: no autocast.

        Returns:
            ``(model, guide)``, Pyro callables of (z, h); for NCL and CL, :meth:`program`'s.
        """
        if not self.gated:
            return self.program(gather, kl_weight, family)
        trained = self._trained_guide() if estimator is None else poutine.reparam(self.guide, config={"g": estimator})
        return self._program(trained, gather, kl_weight, family, mlp_dtype, unweighted=True)

    def _program(self, guide_fn, gather, kl_weight, family, mlp_dtype=None, unweighted=False):
        """(model, guide) closures of (z, h) over the model and ``guide_fn``, lambda read when they run.

        ``unweighted``: the gradient into the prior's parameters and its guide's through the program is divided by
        lambda (``nn.gradient_scale``): their whole objective sits inside the lambda-weighted KL, so they learn at a
        step that does not depend on lambda.
        """
        def weight():
            return self.kl_weight if kl_weight is None else kl_weight

        def scale():
            return 1.0 / weight() if unweighted else None

        def model(z, h):
            return self.model(z, h, gather=gather, kl_weight=weight(), prior_grad_scale=scale())

        def guide(z, h):
            return guide_fn(z, h, kl_weight=weight(), family=family, mlp_dtype=mlp_dtype, prior_grad_scale=scale())

        return model, guide if self.gated else _no_guide

    def _trained_guide(self):
        """The guide under the head's estimator (``poutine.reparam``), built again only when either is replaced.

        A handler holds no state between calls, and building it at every step costs more than the site it handles.
        """
        built = self.__dict__.get("_trained")
        if built is None or built[0] is not self.guide or built[1] is not self.estimator:
            built = self.__dict__["_trained"] = (self.guide, self.estimator,
                                                 poutine.reparam(self.guide, config={"g": self.estimator}))
        return built[2]

    def elbo(self, estimator: GateEstimator | None = None) -> MeanFieldELBO:
        """The ELBO the head trains with.

        Args:
            estimator: the gate estimator whose ELBO to give; None (the default): the head's.

        Returns:
            The estimator's ``GateEstimator.elbo``, which holds its KL clamp; for NCL and CL the mean-field ELBO (no
            latent site).
        """
        if not self.gated:
            return MeanFieldELBO()
        return (estimator or self.estimator).elbo()

    def svi_program(self):
        """``(model, guide)`` for Pyro's ``SVI`` with :meth:`elbo`, callables of backbone features h.

        ``SVI(*head.svi_program(), optim, head.elbo()).step(h)`` takes one step on the head's -ELBO (its loss times 2N;
        the backbone is the caller's). The program is :meth:`training_program`, with the projector run in the model and
        every parameter of the head declared to Pyro (``pyro.module``): ``SVI`` steps only the parameters its traces
        name, and the program alone names none for the ``bernoulli`` and ``learned`` priors. With a density target the
        model adds the constraint's term, a factor of value 0. Step inside :func:`own_params` (the parameters enter
        Pyro's param store); call :meth:`update_density` after each step.

        Returns:
            ``(model, guide)``, Pyro callables of R x D backbone features h (rows ``[view 1; view 2]``).
        """
        model, guide = self.training_program()

        def svi_model(h):
            pyro.module("bayesncl_head", self)
            made = model(self.projector(h), h)
            if self.density is not None:  # the constraint's term (value 0) on -ELBO's scale, 2N times the loss's
                term = self.density.term(self.estimator.mask_probs(self.guide.posterior(h)))
                pyro.factor("density", -self.num_rows * term)
            return made

        def svi_guide(h):
            pyro.module("bayesncl_head", self)
            return guide(None, h)

        return svi_model, svi_guide

