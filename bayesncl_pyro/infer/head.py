"""The gates as a loss module for your own training loop, on any backbone: :class:`BayesNCLHead`.

    backbone = torchvision.models.resnet50()
    backbone.fc = torch.nn.Identity()                                   # images -> h, R x 2048
    head = BayesNCLHead(2048, num_train=len(train_set))
    optimizer = torch.optim.SGD(head.param_groups(lr=0.3, backbone=backbone), lr=0.3, momentum=0.9)
    loss, out = head(backbone(torch.cat([view1, view2])))               # rows [view 1; view 2]
    optimizer.zero_grad(); loss.backward(); optimizer.step()
    head.update_density(out)                                            # with gate_density: lambda's next value

The head takes the backbone's features h, not projections: it owns the projector (h -> z, the reference's
2-layer MLP), the gating head that infers the gates from h.detach(), the prior, the Pyro model and guide
and the ELBO, so the backbone is all a training loop brings. Its loss is ``-ELBO / 2N`` (``models/bayesncl.py``)
as the gate estimator estimates it; with the default ``ste``, the reference's surrogate, InfoNCE at the posterior
mode (:attr:`BayesNCLHead.objective` says which). With ``prior=None`` the same head is NCL (no gates), and with
``nonneg="none"`` as well, SimCLR; the Trainer trains all three through it.

The head's arguments are named in one place, its signature (a Config's fields of the same names are its arguments:
``infer.learner.head_arguments``), and checked in one, :func:`check_arguments`: the head calls it, and
``train.resolve`` calls it with ``flags=True`` to check a Config's fields under run_svi.py's flag names.

In your own loop, turn Pyro's validation off (``pyro.enable_validation(False)``, as the Trainer does): with it
on, every step also computes each site's log-density and runs Pyro's checks of the program, which the loss does
not need.
"""

import contextlib
import dataclasses
import functools
import os
import weakref

import pyro
import torch
from pyro import poutine
from pyro.nn import PyroModule
from torch import nn
from torch.distributions import Distribution

from bayesncl_pyro import distributed
from bayesncl_pyro._deprecated import renamed
from bayesncl_pyro.errors import UserError, quoted
from bayesncl_pyro.guides.gates import BernoulliGates, GateGuide
from bayesncl_pyro.infer.density import DensityControl, check_gate_density
from bayesncl_pyro.infer.elbo import ELBOTerms, MeanFieldELBO
from bayesncl_pyro.infer.estimators import GATES, Draw, GateEstimator, LocalExpectation, gate_class
from bayesncl_pyro.models.bayesncl import ContrastiveModel, computed
from bayesncl_pyro.models.priors import Prior, build_prior, checked_guide
from bayesncl_pyro.nn.encoders import mlp
from bayesncl_pyro.nn.losses import ACTIVE_EPS, NONNEG, REFERENCE_KL_CLAMP, bernoulli_kl_grad, info_nce_rows, normalize

# the head's arguments that must be positive, with what to pass instead
_POSITIVE = dict(proj_dim="256", proj_hidden="2048", head_depth="2", temperature="0.2 (the reference's)",
                 gate_temperature="1.0", logit_bound="5.0",
                 kl_weight="3e-5 (the published lambda); for no gates at all, no prior (NCL)")


def check_arguments(flags: bool = False, **args):
    """The one check of the head's arguments, refusing a bad value in one line.

    The arguments are given by their names in :class:`BayesNCLHead`'s signature (every one of them; those no rule here
    concerns pass through). The head calls it, and so does ``train.resolve`` with ``flags=True``, which names them as
    run_svi.py's flags. A value that would give a wrong loss without a word (a clamp of 0.5 or more: a KL of exactly 0;
    a logit bound of 0: every gate closed) or fail deep inside Pyro is refused in one line that names the argument and
    the fix.
    """
    name = (lambda n: "--" + n.replace("_", "-")) if flags else (lambda n: n)  # noqa: E731
    for arg, valid in (("gate", tuple(GATES)), ("nonneg", NONNEG)):
        if args[arg] not in valid:
            raise UserError(f"unknown {name(arg)} {quoted(args[arg])}; choose one of: {', '.join(valid)}")
    for arg, example in _POSITIVE.items():
        if not args[arg] > 0:
            raise UserError(f"{name(arg)} must be positive, got {args[arg]}; pass e.g. {example}")
    if not 0 <= args["kl_clamp"] < 0.5:
        raise UserError(f"{name('kl_clamp')} must lie in [0, 0.5), got {args['kl_clamp']} (from 0.5 on the clamped "
                        "KL is 0): 0.01 is the reference's clamp, 0 the exact KL")
    if not 0 <= args["topk"] <= args["proj_dim"]:
        raise UserError(f"{name('topk')} must lie in [0, {name('proj_dim')}={args['proj_dim']}], got {args['topk']} "
                        "(0 keeps every feature)")
    _check_size(args, name)


def _check_size(args: dict, name):
    """Refuse a projector and gating head whose float32 weights alone would not fit in this machine's memory.

    Building them fails deep in torch's allocator, or their layers are allocated one at a time until the kernel kills
    the process. ``train.resolve`` checks before the backbone is built (and the prior, of K values): 1 stands for the
    backbone's width, unknown there (``in_dim``).
    """
    in_dim, hidden, out_dim = args.get("in_dim", 1), args["proj_hidden"], args["proj_dim"]

    def weights(depth: int) -> int:  # an mlp's (encoders.mlp), bias included
        return (in_dim + 1) * hidden + (depth - 2) * (hidden + 1) * hidden + (hidden + 1) * out_dim if depth > 1 \
            else (in_dim + 1) * out_dim

    need = 4 * (weights(2) + (weights(args["head_depth"]) if args["prior"] is not None else 0))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > memory:
        given = ", ".join(f"{name(arg)}={args[arg]}" for arg in ("proj_hidden", "proj_dim", "head_depth"))
        raise UserError(f"the head's weights alone ({given}) would need {need / 2**30:.3g} GiB, more than this "
                        f"machine's {memory / 2**30:.3g} GiB of memory; lower one of them")


def checked_prior(prior: str | Prior | None, proj_dim: int, prior_prob: float, prior_args: dict | None = None,
                  in_dim: int = 8) -> tuple[Prior | None, PyroModule | None]:
    """Build and check a head's prior: the one place this is done.

    Returns ``(prior, its guide)`` for a registry name, ``package.module:Class`` or a built :class:`Prior` of
    ``proj_dim`` gates, the guide (for backbone features of ``in_dim``, which a prior with row latents reads) checked
    against the prior (``checked_guide``); ``(None, None)`` for None. :class:`BayesNCLHead` calls it, and
    ``train.resolve``, so a bad prior is refused before a run's folder is claimed and its data loaded.
    """
    if prior_args and not isinstance(prior, str):
        raise UserError("prior_args are the arguments of a prior given by name; " + (
            "prior=None has no prior to take them" if prior is None else
            f"a {type(prior).__name__} is built already: pass them to its constructor"))
    if prior is None:
        return None, None
    if isinstance(prior, str):
        prior = build_prior(prior, proj_dim, prior_prob, **(prior_args or {}))
    elif not isinstance(prior, Prior):
        raise UserError(f"prior must be a registry name, package.module:Class, a Prior or None, not a "
                        f"{type(prior).__name__}")
    if prior.num_features != proj_dim:
        raise UserError(f"the prior has {prior.num_features} gates but the head {proj_dim} features; build the "
                        f"prior with num_features={proj_dim} (the head's proj_dim)")
    return prior, checked_guide(prior, in_dim)


def own_params():
    """An empty Pyro param store for the duration, so heads do not share parameters.

    The Pyro modules run inside use their own parameters (a learned prior's rate, a Beta posterior), not an entry of the
    process's global store under the same name, which two heads of one process would share, the second then training a
    parameter its optimizer does not hold. Pyro's ``module_local_params`` is no substitute: it must be on both when a
    module is built and at each call, so set for the process it would break the user's own PyroModules.
    """
    return pyro.get_param_store().scope()


def _no_guide(z, h):
    """NCL and CL have no latent variables: the ELBO is the likelihood factor alone."""


@dataclasses.dataclass(eq=False)
class HeadOutput:
    """What one step of the head (:meth:`BayesNCLHead.forward`) computed, detached but ``gates``.

    The 0-d values stay on the device: ``.item()`` them when you log. The summary figures (the properties) are computed
    from the step's tensors when first read, then kept; read them before anything writes into those tensors (the head
    never does).
    """

    nce: torch.Tensor
    """0-d: the mean InfoNCE per row at the gates training used."""
    kl: torch.Tensor
    """0-d: the KL term per row (summed over the gates, averaged over the rows; plus a prior's global latents' KL /
    2N); 0 without gates."""
    features: torch.Tensor
    """R x K: the rows InfoNCE saw."""
    kl_weight: torch.Tensor | float | None = None
    """With gates: this step's lambda (with a density target, the multiplier's value, 0-d)."""
    gates: torch.Tensor | None = None
    """With gates, R x K: the tensor InfoNCE's gradient reaches, the gate values (for ``leg`` the inclusion
    probabilities its ELBO used), whose gradient :meth:`BayesNCLHead.pulls` reads after ``loss.backward()``."""
    q: BernoulliGates | None = None
    """With gates: q(g | x) of the step's rows."""
    prior: Distribution | None = None
    """With gates: p(g) of the step's rows (for a hierarchical prior, at this step's draw of its global latents)."""
    estimator: GateEstimator | None = None
    """With gates: the gate estimator that trained the step."""

    def unread(self) -> "HeadOutput":
        """The same values with none of the summary figures computed yet.

        It is for tensors rewritten in place since this output was built (a CUDA graph's outputs,
        ``train/graph.py``).
        """
        return dataclasses.replace(self)

    @functools.cached_property
    def active(self) -> torch.Tensor:
        """0-d: the share of feature entries that take part in the loss."""
        return (self.features.abs() > ACTIVE_EPS).float().mean()

    @functools.cached_property
    def probs(self) -> torch.Tensor:
        """R x K: q(g = 1 | x)."""
        return self.q.probs.detach()

    @functools.cached_property
    def kl_probs(self) -> torch.Tensor:
        """R x K: the probabilities the KL was taken at: :attr:`probs`, but sigmoid(l) for ``gs-reference-kl``."""
        return self.estimator.kl_probs(self.q).detach()

    @functools.cached_property
    def prior_rate(self) -> torch.Tensor:
        """K: p(g = 1) of the step's prior, its first row's (a prior with a rate per row has each in ``prior.mean``)."""
        return self.prior.mean[0].detach()

    @functools.cached_property
    def gate_rate(self) -> torch.Tensor:
        """0-d: the mean inclusion probability over all entries."""
        return self.probs.mean()

    @functools.cached_property
    def incl_min(self) -> torch.Tensor:
        """0-d: the mean inclusion probability of the least included dimension."""
        return self.probs.mean(0).min()

    @functools.cached_property
    def incl_max(self) -> torch.Tensor:
        """0-d: the mean inclusion probability of the most included dimension."""
        return self.probs.mean(0).max()

    @functools.cached_property
    def gates_open(self) -> torch.Tensor:
        """0-d: the share of the evaluation mask's open gates."""
        return self.estimator.mask(self.q).float().mean()

    def __getitem__(self, name: str):
        """``out["nce"]``, as the dict the head returned before: deprecated, read the attribute."""
        renamed(f"reading the head's output as out[{name!r}]", f"out.{name} (a HeadOutput's attribute)")
        return getattr(self, name)


class BayesNCLHead(nn.Module):
    """Backbone features of 2B view-rows -> (loss, monitoring values).

    Args:
        in_dim: D, the backbone's feature width. The arguments are named as the command-line flags of
            ``experiments/run_svi.py``; the defaults are the published CIFAR recipe's.
        proj_dim: K, the number of features and gates; proj_hidden: the projector's and gating head's width.
        num_train: N, images in the training set (the ELBO's rows plate is 2N).
        prior: a registry name (``bernoulli``, ``learned``, ``beta-bernoulli``), ``package.module:Class``, a
            :class:`~bayesncl_pyro.models.priors.Prior`, or None for NCL / CL (no gates).
        prior_prob: rho, the prior inclusion rate (or its mean); prior_args: the other arguments of a prior given
            by name.
        kl_weight: lambda; kl_clamp: the KL's rates are clamped to [c, 1 - c] (0.01 as the reference, 0 = the
            exact KL); gate_density: a target share of open gates (of the evaluation mask), which makes lambda a
            Lagrange multiplier, kl_weight its start, updated by :meth:`update_density` after every training step
            (``bayesncl_pyro/infer/density.py``; None: lambda fixed); gate: how training differentiates through the
            gates, a name in ``bayesncl_pyro/infer/estimators.py``'s ``GATES`` (``ste``, ``relaxed``,
            ``st-sampled``, ``leg``, ``gs``, ``gs-reference-kl``; it also picks q's family); gate_temperature,
            head_depth, logit_bound: the guide's.
        temperature: InfoNCE tau; nonneg: ``rep_relu`` | ``relu`` | ``none`` (SimCLR); topk: keep the k
            largest features per row (0: all).
        gather_distributed: under ``torch.distributed`` with several ranks, contrast each row against the rows
            of every rank (global negatives; a plain run is unaffected).

    The prior's global parameters (a learned rate, the Beta posterior of ``beta-bernoulli``) get their gradient
    divided by lambda (a hook on each): their whole objective sits inside the lambda-weighted KL, so this makes
    their step independent of lambda under any optimiser (:meth:`param_groups`).

    A forward pass changes nothing of the head. With ``gate_density``, a training loop calls
    :meth:`update_density` with the step's output after ``optimizer.step()``: that moves lambda. For Pyro's ``SVI``:
    :meth:`svi_program` and :meth:`elbo`.
    """

    def __init__(self, in_dim: int, proj_dim: int = 256, proj_hidden: int = 2048, *, num_train: int,
                 prior: str | Prior | None = "bernoulli", prior_prob: float = 0.8, prior_args: dict | None = None,
                 kl_weight: float = 3e-5, kl_clamp: float = REFERENCE_KL_CLAMP, gate: str = "ste",
                 gate_temperature: float = 1.0, head_depth: int = 2,
                 logit_bound: float = 5.0, temperature: float = 0.2, nonneg: str = "rep_relu", topk: int = 0,
                 gather_distributed: bool = False, gate_density: float | None = None):
        check_arguments(**locals())  # every argument, by its name in this signature
        super().__init__()
        if not num_train >= 2:
            raise UserError(f"num_train must be the number of images in the training set (at least 2), got {num_train}")
        prior, rate_guide = checked_prior(prior, proj_dim, prior_prob, prior_args, in_dim)
        self.projector = mlp(in_dim, proj_hidden, proj_dim)
        num_rows = 2 * num_train
        self.model = ContrastiveModel(num_rows, temperature, nonneg, topk, prior, kl_weight)
        self.estimator = gate_class(gate)(kl_clamp) if prior is not None else None
        self.guide = GateGuide(
            in_dim, proj_hidden, proj_dim, num_rows, depth=head_depth, family=self.estimator.family,
            temperature=gate_temperature, logit_bound=logit_bound, kl_weight=kl_weight, rate_guide=rate_guide,
            row_latents=prior.row_latents,
        ) if prior is not None else None
        self.gather_distributed = gather_distributed
        self.density = None
        if gate_density is not None:
            if prior is None:
                raise UserError("gate_density is a target share of open gates; a head without a prior (NCL, CL) has "
                                "no gates: drop gate_density or give a prior")
            check_gate_density(gate_density, "bayesncl", prior.prior_prob)
            self.density = DensityControl(gate_density, kl_weight, prior.prior_prob)
        self._unweighted = {}  # id(parameter) -> (parameter, the handle of its hook)
        self._unweight_prior_gradients()

    @property
    def gated(self) -> bool:
        """Whether the head has gates (a prior), not NCL or CL."""
        return self.guide is not None

    @property
    def num_rows(self) -> int:
        """2N, the view-rows of the training set: the rows plate's size."""
        return self.model.num_rows

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, HeadOutput]:
        """h: R x D backbone features of the rows ``[view 1 of B images; view 2 of the same B images]``.

        Returns the loss training minimises, ``-ELBO / 2N`` as the gate estimator estimates it (for ``ste`` and
        ``gs-reference-kl`` the reference's surrogate instead: :attr:`objective`), and what the step computed
        (:class:`HeadOutput`). Nothing of the head changes: with a density target, call :meth:`update_density` after
        the optimizer step.
        """
        self._check_rows(h)
        z = self.projector(h)  # under the caller's autocast, if any
        dtype = self.projector[0].weight.dtype
        kl_weight = self.kl_weight
        with self._program_precision(h.device.type):
            gather = distributed.gather_rows if self.gather_distributed else None
            loss, kl, model_trace, guide_trace = self.elbo_terms(z.to(dtype), h.to(dtype), gather,
                                                                 kl_weight=kl_weight)
            made = computed(model_trace)
            gated = {}
            if self.gated:
                # the tensor whose gradient is InfoNCE's alone: the gates, for leg the probabilities its ELBO used
                site = guide_trace.nodes["g"]
                gates = site["infer"].get("local_expectation_probs", model_trace.nodes["g"]["value"])
                if gates.requires_grad:
                    gates.retain_grad()  # read by pulls() after backward
                gated = dict(kl_weight=kl_weight, gates=gates, q=site["fn"].base_dist,
                             prior=model_trace.nodes["g"]["fn"], estimator=self.estimator)
        return loss, HeadOutput(nce=made["row_nce"].mean(), kl=kl, features=made["features"], **gated)

    @property
    def kl_weight(self) -> torch.Tensor | float:
        """lambda, the KL's weight of the next step.

        With a density target it is the multiplier's current value (a new 0-d tensor at each read, so a step keeps
        its own), else the constructor's ``kl_weight``.
        """
        return self.density.weight() if self.density is not None else self.model.kl_weight

    @torch.no_grad()
    def update_density(self, out: HeadOutput):
        """With a density target, one step of the multiplier from a training step's output.

        The target is ``gate_density``, and the step is taken from the share of open gates of ``out``. Call it once per
        training step, after ``optimizer.step()`` (the prior's gradients are divided by the step's lambda during
        ``backward``); the next step's lambda is the new multiplier. Without a target it does nothing.
        """
        if self.density is not None:
            self.density.update(out.gates_open)

    @contextlib.contextmanager
    def _program_precision(self, device_type: str):
        """The Pyro program in full precision under the caller's autocast, the gating MLP not.

        Within, under the caller's autocast: autocast off, so the Pyro program's exps and logs run in full
        precision, but the guide's gating MLP, a matmul of the projector's size, under the caller's autocast as the
        projector. Without one, nothing is entered (a CPU step: entering autocast costs more than the program's small
        ops).
        """
        if not torch.is_autocast_enabled(device_type):
            yield
            return
        if self.gated:
            self.guide.mlp_autocast = torch.get_autocast_dtype(device_type)
        try:
            with torch.autocast(device_type, enabled=False):
                yield
        finally:
            if self.gated:
                self.guide.mlp_autocast = None

    @property
    def objective(self) -> str:
        """What the loss computes, in words: the gate estimator's objective, or for NCL and CL the InfoNCE alone."""
        return self.estimator.objective if self.gated else "InfoNCE per row (no latent variables: -ELBO = InfoNCE)"

    def program(self, gather=None, kl_weight=None, family=None):
        """The head's Pyro program for one batch, as written: ``(model, guide)``.

        Both are Pyro callables of (z, h) (projector outputs and backbone features); with ``gather``
        (``distributed.gather_rows``), the model contrasts each row against every rank's. The KL's weight is
        ``kl_weight`` (default: :attr:`kl_weight` when the program runs); ``family``: q's family (default the guide's).
        Its gate site is discrete (no gate estimator applied): ``pyro.infer.Predictive`` draws from q, and Pyro's ELBOs
        take the score function through it. The model returns what it computed (``models/bayesncl.py``), which
        :meth:`forward` reads from the trace. Run them inside :func:`own_params`, as :meth:`elbo_terms` does; for Pyro's
        ``SVI``, :meth:`svi_program`.
        """
        return self._program(self.guide, gather, kl_weight, family)

    def training_program(self, estimator: GateEstimator | None = None, gather=None, kl_weight=None, family=None):
        """:meth:`program` with a gate estimator applied to the guide's gate site.

        The estimator is the head's by default, applied with ``poutine.reparam``. This is what training differentiates,
        with the estimator's ELBO (``GateEstimator.elbo``: its KL clamp, and ``leg``'s head gradient, which this
        program's traces alone lack). q's family is the guide's unless ``family`` says otherwise.
        """
        if not self.gated:
            return self.program(gather, kl_weight, family)
        trained = self._trained_guide() if estimator is None else poutine.reparam(self.guide, config={"g": estimator})
        return self._program(trained, gather, kl_weight, family)

    def _program(self, guide_fn, gather, kl_weight, family):
        """(model, guide) closures of (z, h) over the model and ``guide_fn``, lambda read when they run."""
        def weight():
            return self.kl_weight if kl_weight is None else kl_weight

        def model(z, h):
            return self.model(z, h, gather=gather, kl_weight=weight())

        def guide(z, h):
            return guide_fn(z, h, kl_weight=weight(), family=family)

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

        It is the ``GateEstimator.elbo`` of the head's estimator (or of ``estimator``), which holds the KL clamp;
        for NCL and CL the mean-field ELBO (no latent site).
        """
        if not self.gated:
            return MeanFieldELBO()
        return (estimator or self.estimator).elbo(self.model.temperature)

    def svi_program(self):
        """``(model, guide)`` for Pyro's ``SVI`` with :meth:`elbo`, callables of backbone features h.

        ``SVI(*head.svi_program(), optim, head.elbo()).step(h)`` takes one step on the head's -ELBO (its loss times 2N;
        the backbone is the caller's). The program is :meth:`training_program`, with the projector run in the model and
        every parameter of the head declared to Pyro (``pyro.module``): ``SVI`` steps only the parameters its traces
        name, and the program alone names none for the ``bernoulli`` and ``learned`` priors, so a bare ``SVI`` on
        :meth:`training_program` trains nothing. The parameters enter Pyro's param store: step inside
        :func:`own_params`. The prior's gradients arrive divided by lambda (:meth:`param_groups`); call
        :meth:`update_density` after each step as with any optimizer.
        """
        model, guide = self.training_program()

        def svi_model(h):
            pyro.module("bayesncl_head", self)
            self._unweight_prior_gradients()
            return model(self.projector(h), h)

        def svi_guide(h):
            pyro.module("bayesncl_head", self)
            return guide(None, h)

        return svi_model, svi_guide

    def elbo_terms(self, z: torch.Tensor, h: torch.Tensor, gather=None, estimator: GateEstimator | None = None,
                   family=None, kl_weight=None) -> ELBOTerms:
        """The one place the head's Pyro program runs in training: loss, KL per row, traces.

        The diagnostics run the program here too, passing another gate ``estimator`` and q ``family``. From projector
        outputs z and backbone features h it gives the loss (:meth:`forward`), its KL term per row (detached) and the
        traces, where what the program computed is read. ``kl_weight``: the step's lambda (default :attr:`kl_weight`).
        It runs inside :func:`own_params`, so no parameter reaches Pyro's global param store.
        """
        self._unweight_prior_gradients()
        kl_weight = self.kl_weight if kl_weight is None else kl_weight
        model, guide = self.training_program(estimator, gather, kl_weight, family)
        with own_params():
            loss, kl, model_trace, guide_trace = self.elbo(estimator).terms(model, guide, z, h)
        return ELBOTerms(loss / self.num_rows, kl / (self.num_rows * kl_weight), model_trace, guide_trace)

    @torch.no_grad()
    def objective_draw(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        """One draw of the objective itself, with the exact KL, whatever the estimator trained.

        For backbone features h of 2B rows: one draw of g ~ q(g | x) (and of the prior's global latents from their q),
        with the exact KL (no clamp). 0-d values:
        ``neg_elbo``, -ELBO / 2N estimated at that draw (unbiased over draws); ``nce``, its InfoNCE term (mean per
        row) and ``kl``, its KL term per row. For NCL and CL, -ELBO = InfoNCE. The rows are contrasted with each
        other only, on one process (no gather across ranks: evaluation runs on rank 0).
        """
        z = self.projector(h)
        kl_weight, draw = self.kl_weight, Draw(kl_clamp=0.0)
        model, guide = self.training_program(draw, kl_weight=kl_weight)
        with own_params():
            loss, kl, model_trace, _ = self.elbo(draw).terms(model, guide, z, h)
        kl = kl / (self.num_rows * kl_weight) if self.gated else kl
        return dict(neg_elbo=loss / self.num_rows, nce=computed(model_trace)["row_nce"].mean(), kl=kl)

    @torch.no_grad()
    def mode_nce(self, h: torch.Tensor) -> torch.Tensor:
        """The InfoNCE of the evaluation's representation, mean per row.

        The representation is :meth:`representation`'s of backbone features h (for gates, at the evaluation mask).
        It is deterministic, so it is taken once per batch beside the draws of :meth:`objective_draw`.
        """
        return info_nce_rows(self.representation(h), self.model.temperature).mean()

    def _check_rows(self, h: torch.Tensor):
        """A batch the loss would get wrong without a word (Python integers only: no device sync)."""
        if h.ndim != 2:
            raise UserError(f"the head takes R x D backbone features, got a tensor of shape {tuple(h.shape)}")
        rows = h.shape[0]
        if rows % 2:
            raise UserError(f"got {rows} rows, an odd number: the head takes the rows of both views of B images, "
                            "[view 1 of the B images; view 2 of the same B] (torch.cat([view1, view2]))")
        gathered = self.gather_distributed and distributed.world_size() > 1  # negatives from the other ranks
        if rows < 4 and not gathered:
            raise UserError(f"got {rows} rows, the views of {rows // 2} image: InfoNCE needs another image for a "
                            "negative; pass a batch of at least 2 images (4 rows)")
        if isinstance(self.estimator, LocalExpectation) and gathered:
            raise UserError("--gate leg trains on one process only: its per-gate differences would need every rank's "
                            "rows and log-partitions, which are not gathered; run leg without torchrun, or train "
                            "with --gate st-sampled under DDP")
        if rows > self.num_rows:
            raise UserError(f"a batch of {rows // 2} images, but num_train={self.num_rows // 2}: num_train is the "
                            "number of images in the training set (the ELBO scales each batch up to it); pass "
                            "len(train_set)")

    def _need_gates(self):
        if not self.gated:
            raise UserError("this head has no gates (prior=None: NCL or CL); build it with a prior for BayesNCL")

    def pulls(self, out: HeadOutput) -> dict[str, float]:
        """After ``loss.backward()``: how hard InfoNCE and the prior pull on the step's gates.

        The step is the one that returned ``out``; the figures are ``gate_nce_pull`` and ``gate_prior_pull``
        (``gate_pulls``, the prior's at the probabilities, the rates and the lambda the step's KL used). Empty
        before the backward, or without gates.
        """
        gates = out.gates
        if gates is None or gates.grad is None:
            return {}
        # each row against its own rates: a prior with a rate per row (per-image) has R x K
        rates = out.prior.mean.detach()
        nce, prior = gate_pulls(gates.grad, out.kl_probs, rates, out.kl_weight, out.estimator.kl_clamp)
        return dict(gate_nce_pull=nce, gate_prior_pull=prior)

    def gate_probs(self, h: torch.Tensor) -> torch.Tensor:
        """The posterior inclusion probabilities q(g_k = 1 | x), R x K, from backbone features h.

        q's family is the gate estimator's.
        """
        self._need_gates()
        return self.guide.posterior(h).probs

    @torch.no_grad()
    def gate_mask(self, h: torch.Tensor) -> torch.Tensor:
        """The 0/1 gates the evaluation uses, R x K, from backbone features h: the posterior mode.

        The mode is 1[q(g = 1 | x) > 0.5]; for ``gs-reference-kl`` the mask is the reference's, 1[sigmoid(l) > 0.5].
        """
        self._need_gates()
        return self.estimator.mask(self.guide.posterior(h))

    @torch.no_grad()
    def representation(self, h: torch.Tensor) -> torch.Tensor:
        """F, the gated representation the method is evaluated on.

        normalise(features(z) * m) with m the evaluation mask (:meth:`gate_mask`) with gates, features(z) without
        (normalise(relu(z)) for NCL, normalise(z) for CL).
        """
        feats = self.ungated_features(h)
        if self.gated:
            feats = normalize(feats * self.gate_mask(h).to(feats))
        return feats

    @torch.no_grad()
    def ungated_features(self, h: torch.Tensor) -> torch.Tensor:
        """The features of backbone features h with every gate open: normalise(relu(z)), as NCL's."""
        return self.model.features(self.projector(h))

    def param_groups(self, lr: float, gate_lr: float = 0.1, backbone: nn.Module | None = None) -> list[dict]:
        """Optimizer groups: encoder, gating head and the prior's global parameters.

        The backbone (if given) and the projector at ``lr``; the gating head at ``gate_lr``
        (0.1 published, not batch-scaled); the prior's global parameters at ``gate_lr`` too, without weight decay.
        Their gradients arrive divided by lambda (:meth:`prior_parameters`; ``grad_scale`` in their group records by
        what, and marks a checkpoint of this scheme), so that their step does not depend on lambda with SGD or LARS
        (Adam is scale-free either way, up to its eps). Clip gradients by group, not over all parameters: the
        prior's are not on the loss's scale.
        """
        encoder = [*(backbone.parameters() if backbone is not None else ()), *self.projector.parameters()]
        groups = [dict(name="encoder", params=encoder, lr=lr)]
        if self.gated:
            groups.append(dict(name="gate_head", params=list(self.guide.head.parameters()), lr=gate_lr))
            prior = self.prior_parameters()
            if prior:
                groups.append(dict(name="prior", params=prior, lr=gate_lr, weight_decay=0.0,
                                   grad_scale=1.0 / float(self.model.kl_weight)))
        return groups

    def prior_parameters(self) -> list[nn.Parameter]:
        """The prior's global parameters: the model's (the prior's) and those of the prior's guide.

        After ``backward`` their ``.grad`` is the loss's gradient divided by lambda (their optimizer group's
        ``grad_scale``). The guide's other parameters are the gating head's.
        """
        if not self.gated:
            return []
        rate_guide = self.guide.rate_guide
        return [*self.model.parameters(), *(rate_guide.parameters() if rate_guide is not None else ())]

    def _unweight(self, grad: torch.Tensor) -> torch.Tensor:
        """The hook on the prior's gradients: divides by this step's lambda.

        lambda is read at each step's backward (:attr:`kl_weight`: the multiplier's value until :meth:`update_density`),
        so a schedule of it is followed.
        """
        return grad / self.kl_weight

    def _unweight_prior_gradients(self):
        """Hook :meth:`_unweight` onto every prior parameter this head has not hooked, keeping the handles.

        Called at construction and at every step: a tensor hook does not travel with a deep copy, a pickle, or a module
        conversion that replaces the parameter, and neither does the record of the handles (:meth:`__getstate__`),
        so a copy hooks its own parameters at its first step. A prior hooked by another head is refused: its
        gradients would be divided twice.
        """
        params = self.prior_parameters()
        if len(params) == len(self._unweighted) and all(map(self._hooks, params)):
            return  # every step but the first of a head or a copy: nothing to hook
        hooked = {}
        for p in params:
            if not p.requires_grad:
                continue
            old = self._unweighted.get(id(p))  # (parameter, handle): the parameter held, so its id stays its own
            if old is None or old[0] is not p:
                if any(head._hooks(p) for head in _HEADS):
                    raise UserError("this prior belongs to another BayesNCLHead already (its gradients are divided by "
                                    "lambda there); build a new prior for this head")
                old = (p, p.register_hook(self._unweight))
                _HEADS.add(self)
            hooked[id(p)] = old
        self._unweighted = hooked

    def _hooks(self, p: nn.Parameter) -> bool:
        """Whether this head divides p's gradient."""
        return self._unweighted.get(id(p), (None,))[0] is p

    def __getstate__(self):
        state = {**super().__getstate__(), "_unweighted": {}}
        state.pop("_trained", None)  # a copy builds its own, around its own guide
        return state


# the heads that hook prior parameters, for the refusal of a prior that another head's hook divides already
_HEADS: "weakref.WeakSet[BayesNCLHead]" = weakref.WeakSet()


def gate_pulls(gate_grad: torch.Tensor, kl_probs: torch.Tensor, rate: torch.Tensor, kl_weight: float,
               kl_clamp: float) -> tuple[float, float]:
    """How hard the likelihood and the prior move the gates on one batch.

    It returns ``(nce, prior)``: the mean over the R x K entries of |R * gate_grad| and of
    |lambda * dKL_ik / dalpha_ik|, both in loss per row per unit of inclusion probability (for the STE gate, whose value
    moves one for one with alpha).

    gate_grad: R x K, the gradient of the trainer's loss (-ELBO / num_rows, the InfoNCE factor's part) w.r.t. the gate
    values; kl_probs: R x K, the probabilities the step's KL was taken at (the guide's ``GateEstimator.kl_probs``);
    rate: K, or R x K for a prior with a rate per row, the rates it was taken against (the model's, for a hierarchical
    prior this step's draw); kl_clamp: the KL's clamp (``bernoulli_kl``). A prior pull far below the InfoNCE pull means
    the prior hardly shapes the posterior (docs/RESULTS.md has the published lambda's ratio).
    """
    kl_grad = bernoulli_kl_grad(kl_probs.float(), rate.float(), kl_clamp)
    return ((gate_grad.float() * gate_grad.shape[0]).abs().mean().item(),
            (kl_weight * kl_grad).abs().mean().item())
