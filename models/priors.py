"""Swappable priors over the feature gates.

A prior is the distribution of a batch of rows' gates: ``prior(rows)`` returns p(g) for R rows, batch shape (R,)
and event shape (K,), and the model samples the gate site ``g`` from it. It is called inside the model, outside the
rows plate, where it may sample global latents of its own (always under the KL weight, see ``models/bayesncl.py``).
Most priors are independent Bernoulli gates and implement only :meth:`Prior.rate`, the K inclusion rates; one that
is not (correlated gates, a rate per row) overrides :meth:`Prior.forward`. The ELBO takes the gates' KL analytically
where one is registered for q's family and the prior's distribution, and as a one-draw Monte Carlo estimate
otherwise (``bayesncl_pyro/infer/elbo.py``). A prior with global latents also supplies the variational family for
them through :meth:`Prior.make_guide`, which the amortized guide calls. A prior with latents of its own per row (a
per-image sparsity level) sets ``row_latents``: it samples them inside the plate over images it is given (an image's two
views share them), and its guide reads each image's backbone features (:attr:`Prior.row_latents`).

To add a prior, subclass :class:`Prior` and pass ``--prior package.module:MyPrior`` (the module must be
importable: installed, or its folder on PYTHONPATH), or decorate it with ``@register("my-name")`` in this file
and pass ``--prior my-name``. Every constructor takes ``num_features`` and ``prior_prob`` (the rate, or its
mean) and validates what it is given; its other arguments come from ``--prior-arg name=value``, converted
to the types its signature declares.
"""

import functools
import itertools
import math
import warnings
from typing import ClassVar

import numpy as np
import pyro
import pyro.distributions as dist
import scipy.special
import torch
import torch.nn.functional as F
from pyro import poutine
from pyro.infer.autoguide import AutoNormal, init_to_median
from pyro.nn import PyroModule, PyroParam
from pyro.util import check_model_guide_match
from torch.distributions import constraints

from bayesncl_pyro.errors import UserError, quoted
from bayesncl_pyro.plugins import Registry, import_spec, is_spec, typed_kwargs

PRIORS: Registry = Registry()  # the registry names of ``--prior``
_INSTANCES = itertools.count()  # each prior's own name in Pyro's param store (Prior.__init__)
register = PRIORS.register


def prior_class(spec: str) -> type["Prior"]:
    """The :class:`Prior` subclass that a ``--prior`` value names: a registry name or ``package.module:Class``."""
    if is_spec(spec):
        cls = import_spec(spec, "--prior")
        if not (isinstance(cls, type) and issubclass(cls, Prior)):
            raise UserError(f"--prior {spec} is not a subclass of bayesncl_pyro.models.priors.Prior")
        return cls
    if spec not in PRIORS:
        raise UserError(f"unknown prior {quoted(spec)}; choose one of: {', '.join(sorted(PRIORS))}, "
                        "or package.module:ClassName")
    return PRIORS[spec]


def prior_args(spec: str, args: dict) -> dict:
    """``--prior-arg`` values checked against the prior's constructor and converted.

    ``--prior-arg`` values (name -> text or value) checked against the prior's constructor, converted to the
    types it declares.
    """
    return typed_kwargs(prior_class(spec), args, {"num_features": "--proj-dim", "prior_prob": "--prior-prob"},
                        f"prior {spec}", "--prior-arg")


def build_prior(spec: str, num_features: int, prior_prob: float, **kwargs) -> "Prior":
    """The prior that ``spec`` names (see :func:`prior_class`), its extra arguments checked by :func:`prior_args`."""
    cls, kwargs = prior_class(spec), prior_args(spec, kwargs)
    try:
        return cls(num_features, prior_prob, **kwargs)
    except (TypeError, ValueError) as e:  # a prior of the user's that checks its arguments its own way
        given = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        raise UserError(f"--prior {spec}{f' ({given})' if given else ''} refused its arguments: {e}") from None


def checked_guide(prior: "Prior", in_dim: int = 8) -> PyroModule | None:
    """``prior.make_guide()``, once the prior and its guide are checked to fit the program.

    It checks, each refusal one line naming the site and the fix: that ``prior(rows)`` is a distribution over R rows
    of K gates (for a prior of Bernoulli gates, :meth:`Prior.rate` gives the K rates in (0, 1)); that its latents are
    continuous (a discrete one has no KL estimate with a gradient here: sum it out); that the guide samples exactly the
    latent sites the prior samples; and Pyro's own ``check_model_guide_match`` (event dimensions and shapes). Otherwise
    the ELBO would fail with a bare KeyError or a broadcast error, or (a rate outside (0, 1), which the KL's clamp
    hides; a guide site missing its ``.to_event(1)``) train without a word. Runs the prior once on a forked random
    stream: building a head draws nothing. ``in_dim``: the width of the backbone features that the guide of a prior
    with row latents reads (``make_guide(in_dim)``); the check runs it on rows of zeros.
    """
    name, k, rows = type(prior).__name__, prior.num_features, 2
    if type(prior).forward is Prior.forward:
        with torch.random.fork_rng(devices=[]), pyro.get_param_store().scope(), torch.no_grad():
            _check_rates(prior, name)
    if prior.row_latents and type(prior).make_guide is Prior.make_guide:
        raise UserError(f"{name} has row_latents, latents per image, whose guide must be amortised (a function of each "
                        "image's backbone features h; Pyro's AutoNormal keeps a parameter per image): write "
                        "make_guide(self, in_dim) returning a PyroModule called as guide(h, plate) that samples them "
                        "inside `with plate:` (per-image's AmortizedLogitGuide is one)")
    guide = prior.make_guide(in_dim) if prior.row_latents else prior.make_guide()
    with torch.random.fork_rng(devices=[]), pyro.get_param_store().scope(), torch.no_grad():
        plate = pyro.plate("images", rows // 2)
        model_trace = poutine.trace(prior).get_trace(*((rows, plate) if prior.row_latents else (rows,)))
        _check_continuous(name, model_trace)
        # a twin of the guide is run here, not the one returned: a PyroModule that has run (an autoguide sets itself up
        # at its first call) cannot join the head's guide as a submodule; the head runs its own once when built
        twin = prior.make_guide(in_dim) if prior.row_latents else prior.make_guide()
        guide_args = (torch.zeros(rows // 2, in_dim), plate) if prior.row_latents else ()
        guide_trace = poutine.trace(twin).get_trace(*guide_args) if twin is not None else None
    model_sites = set(model_trace.stochastic_nodes)
    guide_sites = {n for n, site in guide_trace.iter_stochastic_nodes() if not site["infer"].get("is_auxiliary")} \
        if guide is not None else set()
    if model_sites != guide_sites:
        given = ("returns no guide" if guide is None else
                 f"returns a guide that samples {sorted(guide_sites) or 'nothing'}")
        fix = ("make_guide(in_dim) must return an amortised guide (a PyroModule called as guide(h, plate)) that "
               "samples the same sites" if prior.row_latents else "make_guide() must return a guide (a PyroModule) "
               "that samples the same sites, or leave make_guide() out for the default guide (Pyro's AutoNormal)")
        raise UserError(f"{name} samples the latent sites {sorted(model_sites) or 'none'} but its make_guide() "
                        f"{given}: {fix}")
    if guide is not None:
        _check_guide_shapes(name, model_trace, guide_trace)
    if prior.row_latents and guide is not None:
        _check_amortized(name, prior, in_dim)
    gates = model_trace.nodes["_RETURN"]["value"]
    if not isinstance(gates, torch.distributions.Distribution) or (gates.batch_shape, gates.event_shape) != ((rows,),
                                                                                                           (k,)):
        what = (f"batch shape {tuple(gates.batch_shape)} and event shape {tuple(gates.event_shape)}"
                if isinstance(gates, torch.distributions.Distribution) else f"a {type(gates).__name__}")
        raise UserError(f"{name}({rows}) returned {what}; it must return the distribution of {rows} rows' gates, "
                        f"batch shape ({rows},) and event shape ({k},)")
    return guide


def _check_amortized(name: str, prior: "Prior", in_dim: int, images: int = 7919):
    """Refuse a guide of per-image latents that keeps parameters per image.

    Training hands the program each batch's rows, not their indices in the data set (the images plate subsamples
    ``arange(B)``), so such a guide would train its first B images' parameters on every batch. The probe: the guide run
    on a plate of ``images`` (a prime no width is likely to equal) holding one image; a parameter with a dimension of
    that size is per image. It catches a guide that sizes its parameters by the plate it is given (``plate.size``), as
    Pyro's autoguides do; one sized by a number of its own cannot be told from an amortised one, which is why the
    contract asks for an amortised guide.
    """
    with torch.random.fork_rng(devices=[]), pyro.get_param_store().scope(), torch.no_grad():
        guide = prior.make_guide(in_dim)
        plate = pyro.plate("images", images, subsample=torch.arange(1))
        poutine.trace(guide).get_trace(torch.zeros(1, in_dim), plate)
        shapes = [p.shape for p in guide.parameters()] + [p.shape for p in pyro.get_param_store().values()]
    if any(images in shape for shape in shapes):
        raise UserError(f"{name}'s guide keeps a parameter per image: training passes each batch's rows but not their "
                        "indices in the data set, so it would train the first images' parameters on every batch; "
                        "amortise it, its distribution a function of the images' backbone features h (as per-image's "
                        "AmortizedLogitGuide is)")


def describe(fn: torch.distributions.Distribution) -> str:
    """A site's distribution in words: its type, and the base an ``Independent`` wraps."""
    if isinstance(fn, torch.distributions.Independent):
        return f"{type(fn.base_dist).__name__} (.to_event({fn.reinterpreted_batch_ndims}))"
    return type(fn).__name__


def _check_continuous(name: str, trace):
    """Refuse a discrete latent of the prior's: no estimator here gives its KL a gradient."""
    for site_name, site in trace.iter_stochastic_nodes():
        if site["fn"].support.is_discrete:
            raise UserError(f"{name} samples the discrete latent {site_name!r} ({describe(site['fn'])}), whose KL has "
                            "no pathwise gradient here: sum it out in forward() (return the mixture it makes of the "
                            "gates' laws, torch.distributions.MixtureSameFamily, as notebooks/your_own_prior.ipynb "
                            "does), or make it continuous (a Beta or a logit-Normal rate)")


def _check_guide_shapes(name: str, model_trace, guide_trace):
    """Pyro's ``check_model_guide_match`` on the prior and its guide, its complaints as one line each."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # its warnings (a site in one program only) are refusals here
            check_model_guide_match(model_trace, guide_trace)
    except (ValueError, UserWarning, RuntimeWarning) as e:
        site = next((s for s in model_trace.stochastic_nodes if repr(s) in str(e) or f"'{s}'" in str(e)), None)
        fix = ""
        if site is not None:
            p, q = model_trace.nodes[site]["fn"], guide_trace.nodes[site]["fn"]
            fix = (f": the prior draws {describe(p)} with event shape {tuple(p.event_shape)}, the guide "
                   f"{describe(q)} with event shape {tuple(q.event_shape)}; give the guide's distribution the "
                   "prior's event dimensions (.to_event(n)), or leave make_guide() out for the default guide")
        raise UserError(f"{name}'s guide does not fit its prior ({e}){fix}") from None


def _check_rates(prior: "Prior", name: str):
    """A prior of Bernoulli gates (:meth:`Prior.forward` not overridden): its rates are K values in (0, 1)."""
    rate, k = prior.rate(), prior.num_features
    if not torch.is_tensor(rate) or rate.shape != (k,):
        what = f"shape {tuple(rate.shape)}" if torch.is_tensor(rate) else type(rate).__name__
        raise UserError(f"{name}.rate() returned {what}; it must return the {k} gates' inclusion rates, shape ({k},)")
    if not ((rate >= 0) & (rate <= 1)).all():  # exactly 0 or 1 is float32 rounding (a sigmoid above 17): clamped
        raise UserError(f"{name}.rate() returned rates outside [0, 1] (from {rate.min().item():.3g} to "
                        f"{rate.max().item():.3g}): each is the probability that a gate is on (from logits, return "
                        "their sigmoid)")


def _probability(rate: torch.Tensor) -> torch.Tensor:
    """Rates inside (0, 1): a float32 sigmoid of a logit above 17 (a wide logit prior's draw) rounds to exactly 1."""
    return rate.clamp(torch.finfo(rate.dtype).tiny, 1 - torch.finfo(rate.dtype).eps)


def gate_rates(p: torch.distributions.Distribution, num_draws: int = 256) -> torch.Tensor:
    """Each gate's P(g = 1) under a distribution of gates: its ``mean``, exact.

    A distribution of the user's without one (a coupled ``TorchDistribution`` need not write ``mean``) gets the mean of
    ``num_draws`` draws instead, on a forked random stream (a report or a log line draws nothing from the run's).
    """
    try:
        return p.mean
    except NotImplementedError:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []), torch.no_grad():
            return p.sample((num_draws,)).float().mean(0)


def _check_rate(prior_prob: float) -> float:
    if not 0.0 < prior_prob < 1.0:
        raise UserError(f"prior inclusion rate must lie strictly between 0 and 1, got {prior_prob}; "
                        "pass e.g. --prior-prob 0.8 (the published value)")
    return float(prior_prob)


def _check_concentration(concentration: float):
    if not concentration > 0:
        raise UserError(f"Beta concentration must be positive, got {concentration}; pass e.g. "
                        "--prior-arg concentration=10")


def _check_features(guide, h):
    if guide is not None and h is None:
        raise UserError("row_rates(guide, h) needs the rows' backbone features h with the guide")


class Prior(PyroModule):
    """p(g) for a batch of rows' gates, with any global latents of its own.

    It is called as ``prior(rows)`` (:meth:`forward`); a prior of independent Bernoulli gates implements only
    :meth:`rate`. A subclass's constructor takes ``num_features`` and ``prior_prob`` first and calls
    ``super().__init__(num_features, prior_prob)`` before anything else; its other arguments come from
    ``--prior-arg name=value`` (or a head's ``prior_args``).

    Args:
        num_features: K, the number of gates (the head's ``proj_dim``).
        prior_prob: the prior's inclusion rate rho in (0, 1), or for a prior with a hyperprior its mean; refused
            outside (0, 1).

    Examples:
        >>> class DecayingPrior(Prior):  # later gates rarer: rho_k = prior_prob ** (k / K)
        ...     def rate(self):
        ...         k = torch.arange(1, self.num_features + 1)
        ...         return self.prior_prob ** (k / self.num_features)
        >>> prior = DecayingPrior(16, 0.5)
        >>> prior.mean_rate()[[0, -1]]  # no latents: its rates
        tensor([0.9576, 0.5000])
        >>> head = BayesNCLHead(64, proj_dim=16, proj_hidden=32, num_train=100, prior=prior)
        >>> loss, out = head(torch.rand(8, 64))
    """

    name: ClassVar[str]
    # True for a prior with latents of its own per image: it is called as ``prior(rows, plate)``, plate the plate over
    # the rows' images (half the rows: rows are [view 1 of B images; view 2 of the same B]), and samples them
    # inside ``with plate:`` (the rows plate, subsampled and scaled as the gates are); its guide is built by
    # ``make_guide(in_dim)`` and called as ``guide(h, plate)``, h the rows' backbone features (R x in_dim)
    row_latents: ClassVar[bool] = False

    def __init__(self, num_features: int, prior_prob: float):
        # a name of its own for Pyro's param store: a PyroModule takes the store's value of its parameters' names, so
        # called outside a head (whose program runs in a store of its own, where it is named by its place in the head)
        # a second prior with the same attribute names would otherwise take and train the first one's parameters
        super().__init__(name=f"{type(self).__name__}-{next(_INSTANCES)}")
        self.num_features = num_features
        self.prior_prob = _check_rate(prior_prob)

    def forward(self, rows: int) -> dist.TorchDistribution:
        """The distribution of ``rows`` rows' gates, batch shape (rows,) and event shape (K,).

        It may sample global latents (model side, outside the rows plate). By default the gates are independent
        Bernoullis at :meth:`rate`.

        Args:
            rows: R, the number of view-rows in the batch.

        Returns:
            p(g) of the R rows' gates: by default ``Bernoulli(rate).to_event(1)`` expanded to R rows, the rates
            clamped inside (0, 1).
        """
        return dist.Bernoulli(_probability(self.rate()).expand(rows, -1)).to_event(1)

    def rate(self) -> torch.Tensor:
        """Inclusion rate of each gate, shape (K,), for a prior of independent Bernoulli gates.

        Such a prior is what the default :meth:`forward` gives. It may sample global latents (model side).

        Returns:
            The K rates, each in [0, 1] (a draw of them where they are latent).
        """
        raise NotImplementedError(f"{type(self).__name__} implements neither rate() nor forward(rows)")

    def make_guide(self) -> PyroModule | None:
        """Variational posterior for this prior's latents, or None if it has none.

        By default Pyro's ``AutoNormal`` over the prior's latents (a Normal per latent in its unconstrained space,
        started at the prior's median), so a prior with continuous global latents needs no guide of its own; a prior
        overrides it with a better family (``beta-bernoulli``'s conjugate Beta). It must sample exactly the latent
        sites that :meth:`forward` samples (checked when a head is built: :func:`checked_guide`). With
        ``row_latents``, ``make_guide(in_dim)``: an amortized guide of the rows' backbone features, written by the
        prior.

        Returns:
            Pyro's ``AutoNormal`` over the prior's latent sites, or None for a prior that samples none.
        """
        with torch.random.fork_rng(devices=[]), pyro.get_param_store().scope(), torch.no_grad():
            trace = poutine.trace(self).get_trace(1)
        if not trace.stochastic_nodes:
            return None
        _check_continuous(type(self).__name__, trace)
        # the prior called on one row: its global latents do not depend on the rows; a partial, not the prior itself,
        # so that the guide does not hold the prior's parameters as its own
        return AutoNormal(functools.partial(self, 1), init_loc_fn=init_to_median)

    @torch.no_grad()
    def mean_rate(self, guide: PyroModule | None = None, num_draws: int = 256) -> torch.Tensor:
        """The one point summary of the inclusion rate (K), for reports.

        It is a row's P(g_k = 1) under the prior; with global latents, its mean over ``num_draws`` draws of them from
        ``guide`` (the trained posterior q, ``make_guide()``'s) or, with no guide, from the prior, on a forked random
        stream (a report draws nothing from the run's). A prior whose mean is known in closed form overrides it. With
        ``row_latents`` it is :meth:`row_rates`' mean over rows, under the prior only (q's needs the rows' features).

        Args:
            guide: the trained q of the prior's global latents (:meth:`make_guide`'s); None: the prior itself.
            num_draws: how many draws of the global latents the mean is over (default 256).

        Returns:
            The K mean inclusion rates, detached.

        Raises:
            UserError: a guide is given to a prior with ``row_latents`` (use :meth:`row_rates`).
        """
        if self.row_latents:
            if guide is not None:
                raise UserError(f"{type(self).__name__} has a rate per row: its posterior mean rate needs the rows' "
                                "backbone features; call row_rates(guide, h)")
            return self.row_rates(None, None, num_draws)[0]
        with pyro.get_param_store().scope(), torch.random.fork_rng(devices=[]):
            trace = poutine.trace(self).get_trace(1)
            if not trace.stochastic_nodes:
                return gate_rates(trace.nodes["_RETURN"]["value"], num_draws)[0].detach()
            draws = [gate_rates(self(1) if guide is None else
                                poutine.replay(self, trace=poutine.trace(guide).get_trace())(1), 1)[0]
                     for _ in range(num_draws)]
        return torch.stack(draws).mean(0)

    @torch.no_grad()
    def row_rates(self, guide: PyroModule | None = None, h: torch.Tensor | None = None,
                  num_draws: int = 256) -> torch.Tensor:
        """Each image's P(g_k = 1), R x K, for a prior with ``row_latents``.

        Its latents are drawn ``num_draws`` times from ``guide`` given the images' backbone features h (R x D, one
        row an image), or with no guide from the prior (R = 1), on a forked random stream; the mean over the draws.
        A prior whose mean is known in closed form overrides it.

        Args:
            guide: the trained amortized guide (``make_guide(in_dim)``'s); None: the prior itself.
            h: R x D backbone features, one row an image, needed with a guide; None without one.
            num_draws: how many draws of the latents the mean is over (default 256).

        Returns:
            R x K inclusion rates (1 x K under the prior).

        Raises:
            TypeError: the prior has no ``row_latents``.
            UserError: a guide is given without ``h``.
        """
        if not self.row_latents:
            raise TypeError(f"{type(self).__name__} has no latents per row; its rate is mean_rate()")
        _check_features(guide, h)
        rows = 1 if h is None else len(h)
        with pyro.get_param_store().scope(), torch.random.fork_rng(devices=[]):
            plate = pyro.plate("images", rows, device=h.device if h is not None else None)
            # the gates of both views of each image: the first view's rows are the images'
            run = self if guide is None else None
            draws = [gate_rates((run or poutine.replay(self, trace=poutine.trace(guide).get_trace(h, plate)))(
                2 * rows, plate), 1) for _ in range(num_draws)]
        return torch.stack(draws).mean(0)[:rows]

    def convergence(self, guide: PyroModule, num_rows: int) -> tuple[float, float] | None:
        """Where a slowly converging q of global latents is, and where it tends to.

        For a prior whose q of global latents is known to converge slowly: ``(where q is, where it tends to)``
        in one figure each (for a Beta posterior, its concentration), which ``gates.nc`` marks as reached or not.

        Args:
            guide: the trained q of the prior's global latents (:meth:`make_guide`'s).
            num_rows: 2N, the view-rows of the training set (the head's ``num_rows``).

        Returns:
            ``(where q is, where it tends to)``, or None where there is no such figure (the default).
        """
        return None


@register("bernoulli")
class BernoulliPrior(Prior):
    """g_k ~ Bernoulli(rho), one fixed rate for every gate (the paper's prior; rho = 0.8 published).

    Args:
        num_features: K, the number of gates (the head's ``proj_dim``).
        prior_prob: rho in (0, 1), every gate's rate (default 0.8).
    """

    def __init__(self, num_features: int, prior_prob: float = 0.8):
        super().__init__(num_features, prior_prob)
        self.register_buffer("_rate", torch.full((num_features,), self.prior_prob))

    def rate(self):
        """The fixed rate rho of every gate.

        Returns:
            K copies of rho.
        """
        return self._rate


@register("learned")
class LearnedPrior(Prior):
    """g_k ~ Bernoulli(rho_k) with rho_k a parameter fitted by maximising the ELBO (empirical Bayes).

    Starts at ``prior_prob``; with the exact KL (``kl_clamp=0``) the ELBO's optimum is rho_k = the mean
    posterior inclusion rate of dimension k (under ``gs-reference-kl``, the mean of sigmoid(l); with the
    clamp, the same while the rates stay inside it), so the prior follows what the data use instead of
    pulling every gate to one rate.

    Args:
        num_features: K, the number of gates (the head's ``proj_dim``).
        prior_prob: the rate in (0, 1) that every rho_k starts at (default 0.8).
    """

    def __init__(self, num_features: int, prior_prob: float = 0.8):
        super().__init__(num_features, prior_prob)
        self.logit_rate = PyroParam(torch.full((num_features,), self.prior_prob).logit())

    def rate(self):
        """The learned rates rho_k.

        Returns:
            The K rates, the sigmoid of the learned logits.
        """
        return self.logit_rate.sigmoid()


@register("beta-bernoulli")
class BetaBernoulliPrior(Prior):
    """rho_k ~ Beta(a, b), g_k ~ Bernoulli(rho_k): a per-dimension rate with a hyperprior.

    ``prior_prob`` is the Beta mean a / (a + b) and ``concentration`` is a + b (how strongly the rates
    are tied to that mean). The rates are global latents ("rate") with a Beta posterior per dimension.

    The data set the rates: q(rate) tends to the conjugate posterior, the hyperprior counting as a + b pseudo-rows
    against 2N real ones, but on a large data set training gets its mean there, not its spread (docs/METHOD.md,
    "Hierarchical rates").

    Args:
        num_features: K, the number of gates (the head's ``proj_dim``).
        prior_prob: the Beta mean a / (a + b) in (0, 1) (default 0.8).
        concentration: a + b > 0, how strongly the rates are tied to that mean (default 10).
    """

    def __init__(self, num_features: int, prior_prob: float = 0.8, concentration: float = 10.0):
        super().__init__(num_features, prior_prob)
        _check_concentration(concentration)
        a, b = self.prior_prob * concentration, (1 - self.prior_prob) * concentration
        self.register_buffer("a", torch.full((num_features,), a))
        self.register_buffer("b", torch.full((num_features,), b))

    def rate(self):
        """A draw of the rates rho_k from Beta(a, b).

        Returns:
            The K rates, sampled at the latent site ``rate``.
        """
        return pyro.sample("rate", dist.Beta(self.a, self.b).to_event(1))

    def make_guide(self):
        """q(rate), a Beta per dimension.

        Returns:
            A :class:`BetaRateGuide` started at the prior's a and b.
        """
        return BetaRateGuide(self.a, self.b)

    def mean_rate(self, guide=None, num_draws=256):
        """The Beta mean of q(rate), or of the prior without a guide: exact, no draws.

        Args:
            guide: the trained q of the prior's global latents (:meth:`make_guide`'s); None: the prior itself.
            num_draws: unused: the mean is exact (kept for :meth:`Prior.mean_rate`'s signature).

        Returns:
            The K means a / (a + b), detached.
        """
        return (guide.posterior() if guide is not None else dist.Beta(self.a, self.b)).mean.detach()

    def optimum_concentration(self, num_rows: int) -> float:
        """The concentration a + b of the conjugate posterior q(rate) tends to, mean over features (docs/METHOD.md).

        Args:
            num_rows: 2N, the view-rows of the training set: each adds one to the conjugate posterior's a + b.

        Returns:
            The prior's a + b (mean over features) plus ``num_rows``.
        """
        return (self.a + self.b).mean().item() + num_rows

    def convergence(self, guide, num_rows):
        """(q(rate)'s concentration a + b, that of the conjugate posterior it tends to), means over features.

        Args:
            guide: the trained q(rate), a :class:`BetaRateGuide`.
            num_rows: 2N, the view-rows of the training set.

        Returns:
            (q's a + b, :meth:`optimum_concentration`), each a mean over features.
        """
        return (guide.a + guide.b).mean().item(), self.optimum_concentration(num_rows)


class BetaRateGuide(PyroModule):
    """q(rho_k) = Beta(a_k, b_k), initialised at the prior; ``site``: the name of the latent it samples."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, site: str = "rate"):
        super().__init__()
        self.a = PyroParam(a.clone(), constraint=constraints.positive)
        self.b = PyroParam(b.clone(), constraint=constraints.positive)
        self.site = site

    def posterior(self) -> dist.Beta:
        """q(rate) = Beta(a, b), batch shape K."""
        return dist.Beta(self.a, self.b)

    def forward(self):
        """Sample the latent from q."""
        return pyro.sample(self.site, self.posterior().to_event(1))


def stick_alpha(num_features: int, mean_rate: float) -> float:
    """The alpha of Beta(alpha, 1) sticks whose rates have ``mean_rate`` as mean.

    The rate of dimension k is v_1 ... v_k, and the mean is over the K dimensions under the prior: with
    m = E[v] = alpha / (alpha + 1), mean_k m^k = mean_rate (bisection on m).
    """
    lo, hi = 0.0, 1.0
    for _ in range(200):
        m = (lo + hi) / 2
        lo, hi = (m, hi) if _mean_over_dims(m, num_features) < mean_rate else (lo, m)
    m = (lo + hi) / 2
    return m / (1 - m)


def _mean_over_dims(m, num_features: int):
    """mean_k m^k over k = 1 ... K, for m in (0, 1) (a geometric series)."""
    return m * (1 - m ** num_features) / ((1 - m) * num_features)


def _mean_sigmoid(loc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E[sigmoid(u)] for u ~ Normal(loc, scale), elementwise, by Gauss-Hermite quadrature on 64 nodes (no draws)."""
    nodes, weights = (torch.as_tensor(v, dtype=loc.dtype, device=loc.device)
                      for v in np.polynomial.hermite_e.hermegauss(64))
    return ((loc[..., None] + scale[..., None] * nodes).sigmoid() @ weights / math.sqrt(2 * math.pi)).detach()


@functools.lru_cache(maxsize=8)
def _laguerre(nodes: int, shape: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalised Gauss-Laguerre nodes and weights: ibp_alpha_mean's bisection asks for the same ones 100 times."""
    return scipy.special.roots_genlaguerre(nodes, shape - 1)


def _gamma_expectation(f, shape: float, rate: float, nodes: int = 96) -> np.ndarray:
    """E[f(alpha)] for alpha ~ Gamma(shape, rate), by generalised Gauss-Laguerre quadrature (no draws)."""
    x, w = _laguerre(nodes, shape)
    values = np.stack([np.asarray(f(xi / rate), dtype=np.float64) for xi in x])
    return np.tensordot(w, values, axes=1) / math.gamma(shape)


def ibp_alpha_mean(num_features: int, mean_rate: float, shape: float) -> float:
    """The mean alpha_0 of the ibp prior's Gamma(shape, shape / alpha_0) hyperprior on alpha.

    Under it the rates' prior mean over the K dimensions is ``mean_rate`` (bisection on log alpha_0, the expectation
    by quadrature).
    """
    lo, hi = math.log(1e-4), math.log(1e9)
    for _ in range(100):
        mid = (lo + hi) / 2
        alpha0 = math.exp(mid)
        mean = _gamma_expectation(lambda a: _mean_over_dims(a / (a + 1), num_features), shape, shape / alpha0)
        lo, hi = (mid, hi) if mean < mean_rate else (lo, mid)
    return math.exp((lo + hi) / 2)


@register("ibp")
class StickBreakingPrior(Prior):
    """The Indian buffet's stick-breaking rates, decaying with k at a speed the data set.

    With alpha ~ Gamma(shape, shape / alpha_0), v_j ~ Beta(alpha, 1), rho_k = v_1 v_2 ... v_k and
    g_k ~ Bernoulli(rho_k), the rates decay with k (later dimensions are rarer), and how fast is itself a latent.

    ``prior_prob`` is the rates' prior mean over the K dimensions, which fixes alpha_0, the hyperprior's mean
    (:func:`ibp_alpha_mean`). A mean rate of 0.8 over 256 dimensions needs sticks near 1 (alpha = 553 there, the
    :func:`stick_alpha` of a fixed alpha), and with alpha fixed the sticks are Beta(553, 1), 0.998 +- 0.002: the decay
    would be the prior's, not the data's. With the hyperprior (``shape``: 2 by default, a coefficient of variation
    of 0.71) alpha, and with it the speed of the decay, has a posterior of its own. The sticks and alpha are global
    latents ("stick", "alpha") with the default guide, Pyro's ``AutoNormal``: a log-normal alpha and a logit-normal
    per stick, their locations started at the prior's medians and their scales at AutoNormal's 0.1; the rates are the
    sticks' running products. A Beta q per stick has an analytic KL but not a stable gradient: gates that want every
    rate near 1 grew its first stick's a twofold a step until Beta's reparameterised gradient was NaN (step 36 of a
    compositional run at ``--gate-density 0.3``), where a logit's location moves linearly and its sigmoid saturates.

    Args:
        num_features: K, the number of gates (the head's ``proj_dim``).
        prior_prob: the rates' prior mean over the K dimensions, in (0, 1) (default 0.8); it fixes alpha_0.
        shape: > 0, the shape of alpha's Gamma hyperprior (default 2: a coefficient of variation of 0.71).
    """

    def __init__(self, num_features: int, prior_prob: float = 0.8, shape: float = 2.0):
        super().__init__(num_features, prior_prob)
        if not shape > 0:
            raise UserError(f"the ibp prior's shape (of alpha's Gamma hyperprior) must be positive, got {shape}; "
                            "pass e.g. --prior-arg shape=2")
        self.alpha = ibp_alpha_mean(num_features, self.prior_prob, float(shape))
        self.register_buffer("shape", torch.tensor(float(shape)))
        self.register_buffer("alpha_rate", torch.tensor(float(shape) / self.alpha))
        self.register_buffer("b", torch.ones(num_features))

    def rate(self):
        """The rates rho_k = v_1 ... v_k from a draw of alpha and of the sticks given it.

        Returns:
            The K rates, the running product of the sticks (latent sites ``alpha`` and ``stick``).
        """
        alpha = pyro.sample("alpha", dist.Gamma(self.shape, self.alpha_rate))
        # a float32 product of many sticks can round to 0 (or a first stick to 1): the default forward clamps
        return pyro.sample("stick", dist.Beta(alpha.expand(self.num_features), self.b).to_event(1)).cumprod(-1)

    @torch.no_grad()
    def mean_rate(self, guide=None, num_draws=256):
        """E[rho_k], by quadrature (no draws).

        Under the default q, prod_{j <= k} E[v_j] (the sticks are independent under q), each E[sigmoid(u_j)] by
        Gauss-Hermite; under the prior, E_alpha[(alpha / (alpha + 1))^k], by Gauss-Laguerre over alpha. A guide of the
        user's own: the mean over ``num_draws`` draws (:meth:`Prior.mean_rate`).

        Args:
            guide: the trained q of alpha and the sticks (the default ``AutoNormal``, or a guide of the user's); None:
                the prior itself.
            num_draws: the draws for a guide of the user's own (default 256); unused otherwise.

        Returns:
            The K mean rates.
        """
        if isinstance(guide, AutoNormal) and hasattr(guide, "locs"):  # the default guide, set up: logit-normal sticks
            return _mean_sigmoid(guide.locs.stick, guide.scales.stick).cumprod(-1)
        if guide is not None:
            return super().mean_rate(guide, num_draws)
        k = np.arange(1, self.num_features + 1)
        mean = _gamma_expectation(lambda a: (a / (a + 1)) ** k, self.shape.item(), self.alpha_rate.item())
        return torch.as_tensor(mean, dtype=self.b.dtype, device=self.b.device)


@register("logit-normal")
class LogitNormalPrior(Prior):
    """A rate per dimension with a Normal hyperprior on its logit.

    logit(rho_k) ~ Normal(logit(prior_prob), scale), g_k ~ Bernoulli(rho_k): a rate per dimension with a
    hyperprior on the logit scale, whose q is a Normal on the logit per dimension (no Beta).

    ``prior_prob`` is the rate at the prior's median (its mean is pulled towards 1/2 by ``scale``); ``scale`` is how
    far the dimensions' rates may spread, in logits.

    Args:
        num_features: K, the number of gates (the head's ``proj_dim``).
        prior_prob: the rate in (0, 1) at the prior's median, sigmoid of the logits' mean (default 0.8).
        scale: > 0, the standard deviation of the logits (default 1).
    """

    def __init__(self, num_features: int, prior_prob: float = 0.8, scale: float = 1.0):
        super().__init__(num_features, prior_prob)
        if not scale > 0:
            raise UserError(f"the logit-normal prior's scale must be positive, got {scale}; pass e.g. "
                            "--prior-arg scale=1")
        self.register_buffer("loc", torch.full((num_features,), math.log(self.prior_prob / (1 - self.prior_prob))))
        self.register_buffer("scale", torch.full((num_features,), float(scale)))

    def rate(self):
        """The rates: the sigmoid of a draw of their logits.

        Returns:
            The K rates (the logits sampled at the latent site ``logit_rate``).
        """
        return pyro.sample("logit_rate", dist.Normal(self.loc, self.scale).to_event(1)).sigmoid()

    def make_guide(self):
        """q(logit rate), a Normal per dimension.

        Returns:
            A :class:`NormalLogitGuide` started at the prior's location and scale.
        """
        return NormalLogitGuide(self.loc, self.scale)

    @torch.no_grad()
    def mean_rate(self, guide=None, num_draws=256):
        """E[sigmoid(l_k)] under q (or the prior) by Gauss-Hermite quadrature on 64 nodes (no draws).

        Args:
            guide: the trained q of the prior's global latents (:meth:`make_guide`'s); None: the prior itself.
            num_draws: unused: the mean is by quadrature (kept for :meth:`Prior.mean_rate`'s signature).

        Returns:
            The K mean rates.
        """
        loc, scale = (guide.loc, guide.scale) if guide is not None else (self.loc, self.scale)
        return _mean_sigmoid(loc, scale)


class NormalLogitGuide(PyroModule):
    """q(logit rho_k) = Normal(loc_k, scale_k), initialised at the prior."""

    def __init__(self, loc: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.loc = PyroParam(loc.clone())
        self.scale = PyroParam(scale.clone(), constraint=constraints.positive)

    def forward(self):
        """Sample the logit rates from q."""
        return pyro.sample("logit_rate", dist.Normal(self.loc, self.scale).to_event(1))


@register("per-image")
class PerImagePrior(Prior):
    """A sparsity level per image, s_i ~ Beta(a, b), with an amortized logit-normal guide.

    s_i ~ Beta(a, b) for each image i, g_ik ~ Bernoulli(s_i) for the gates of both its views: a sparsity level of
    each image's own, with an amortized guide q(s_i | x_i) from the image's backbone features (its two views').

    ``prior_prob`` is the Beta mean a / (a + b) and ``concentration`` is a + b, as for ``beta-bernoulli``; here the
    rate is shared by an image's 2K gates and not by the images. q is logit-normal (:class:`AmortizedLogitGuide`),
    its KL one pathwise draw: a Beta q's concentration, pulled by an image's 2K gates at once, ran from 10 to 5.6e17 by
    step 34 on 3 of 10 seeds of a compositional run at ``--gate-density 0.3`` (one thread), where a logit's location
    moves linearly.

    Args:
        num_features: K, the number of gates (the head's ``proj_dim``).
        prior_prob: the Beta mean a / (a + b) in (0, 1) (default 0.8).
        concentration: a + b > 0 (default 10).
    """

    row_latents = True

    def __init__(self, num_features: int, prior_prob: float = 0.8, concentration: float = 10.0):
        super().__init__(num_features, prior_prob)
        _check_concentration(concentration)
        self.register_buffer("a", torch.tensor(self.prior_prob * concentration))
        self.register_buffer("b", torch.tensor((1 - self.prior_prob) * concentration))

    def forward(self, rows, plate):
        """Each image's sparsity s_i (in the images plate), and its two views' gates at rate s_i.

        Args:
            rows: R = 2B, the view-rows ``[view 1 of B images; view 2 of the same B]``.
            plate: the plate over the B images, inside which s_i is sampled (latent site ``image_rate``).

        Returns:
            p(g) of the R rows' gates, ``Bernoulli(s_i).to_event(1)``, an image's two rows at its s_i.
        """
        with plate:
            rate = pyro.sample("image_rate", dist.Beta(self.a, self.b).expand([rows // 2]))
        rate = rate.repeat(2)  # rows [view 1 of B images; view 2 of the same B]: an image's views share its rate
        return dist.Bernoulli(rate.unsqueeze(-1).expand(rows, self.num_features)).to_event(1)

    def make_guide(self, in_dim):
        """The amortized q(s_i | x_i) of each image's backbone features.

        Args:
            in_dim: D, the width of the backbone features it reads.

        Returns:
            An :class:`AmortizedLogitGuide`, started at the Beta prior's logit moments.
        """
        return AmortizedLogitGuide(in_dim, self.num_features, self.a, self.b)

    @torch.no_grad()
    def row_rates(self, guide=None, h=None, num_draws=256):
        """E[s_i] for each image, without draws: q's by Gauss-Hermite given the image's features, or the prior's.

        Args:
            guide: the trained :class:`AmortizedLogitGuide`; None: the prior itself.
            h: R x D backbone features, one row an image, needed with a guide; None without one.
            num_draws: unused: the mean is by quadrature (kept for :meth:`Prior.row_rates`' signature).

        Returns:
            R x K rates, each image's E[s_i] for all its gates (1 x K under the prior).
        """
        _check_features(guide, h)
        if guide is None:
            mean = (self.a / (self.a + self.b)).reshape(1)
        else:
            loc, scale = guide.location(h)
            mean = _mean_sigmoid(loc, scale.expand_as(loc))
        return mean.unsqueeze(-1).expand(-1, self.num_features).detach()


class AmortizedLogitGuide(PyroModule):
    """q(s_i | x_i): logit s_i ~ Normal(m_i, sigma), its location amortized from the image's backbone features.

    m_i = (w . h_i / |h_i| + b) / sqrt(K) from the image's backbone features h_i (detached: the prior's guide does not
    train the backbone), sigma one parameter. An image's gates all pull on s_i, so its gradient is K times a
    dimension's: the 1 / sqrt(K) keeps the optimizer's step in m_i a dimension's size whatever K. It starts at the
    Beta prior's logit moments for every row (w = 0: the mean digamma(a) - digamma(b), the sd
    sqrt(trigamma(a) + trigamma(b))), drawing nothing from the random stream.
    """

    def __init__(self, in_dim: int, num_features: int, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.root_k = math.sqrt(num_features)
        a, b = float(a), float(b)
        loc = scipy.special.digamma(a) - scipy.special.digamma(b)
        self.weight = torch.nn.Parameter(torch.zeros(in_dim))
        self.bias = torch.nn.Parameter(torch.tensor(loc * self.root_k, dtype=torch.float32))
        sd = math.sqrt(scipy.special.polygamma(1, a) + scipy.special.polygamma(1, b))
        self.scale = PyroParam(torch.tensor(sd, dtype=torch.float32), constraint=constraints.positive)

    def location(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(m, sigma): q's logit location for backbone features h (R x D), R, and its scale, 0-d."""
        h = F.normalize(h.detach(), dim=-1)
        return (h @ self.weight + self.bias) / self.root_k, self.scale

    def posterior(self, h: torch.Tensor) -> dist.TransformedDistribution:
        """q(s | x) for backbone features h (R x D): logit-normal, batch shape (R,).

        torch's sigmoid transform clamps s inside (0, 1), so a float32 draw never rounds to 0 or 1.
        """
        loc, scale = self.location(h)
        return dist.TransformedDistribution(dist.Normal(loc, scale.expand_as(loc)),
                                            [dist.transforms.SigmoidTransform()])

    def forward(self, h, plate):
        """Sample each image's s_i from q(s_i | x_i) in the images plate."""
        with plate:
            return pyro.sample("image_rate", self.posterior(h))
