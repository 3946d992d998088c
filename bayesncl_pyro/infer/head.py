"""The gates as a loss module for your own training loop, on any backbone: :class:`BayesNCLHead`.

    backbone = torchvision.models.resnet50()
    backbone.fc = torch.nn.Identity()                                   # images -> h, R x 2048
    head = BayesNCLHead(2048, num_train=len(train_set))
    optimizer = torch.optim.SGD(head.param_groups(lr=0.3, backbone=backbone), lr=0.3, momentum=0.9)
    loss, out = head(backbone(torch.cat([view1, view2])))               # rows [view 1; view 2]
    optimizer.zero_grad(); loss.backward(); optimizer.step()
    head.update_density(out)                                            # with gate_density: the multiplier's step

The head takes the backbone's features h, not projections: it owns the projector (h -> z, the reference's
2-layer MLP), the gating head that infers the gates from h.detach(), the prior, the Pyro model and guide
and the ELBO, so the backbone is all a training loop brings. Its loss is ``-ELBO / 2N`` (``models/bayesncl.py``)
as the gate estimator estimates it; with the default ``ste``, the reference's surrogate, InfoNCE at the posterior
mode (:attr:`BayesNCLHead.objective` says which). With ``prior=None`` the same head is NCL (no gates), and with
``nonneg="none"`` as well, SimCLR; the Trainer trains all three through it.

Where the rest lives: its arguments and prior are checked in ``infer/checks.py``, its step's output is
``infer/output.py``'s, its Pyro program (model and guide, as written and under a gate estimator) and ELBO are
``infer/program.py``'s, the prior's gradients are divided by lambda along the program's path
(``nn/gradient_scale.py``), and its evaluation figures are ``infer/evaluation.py``'s.

In your own loop, turn Pyro's validation off (``pyro.enable_validation(False)``, as the Trainer does): with it
on, every step also computes each site's log-density and runs Pyro's checks of the program, which the loss does
not need.
"""

import contextlib
import logging

import torch
from torch import nn

from bayesncl_pyro import distributed
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.guides.gates import GateGuide
from bayesncl_pyro.infer.checks import check_arguments as check_arguments  # re-exported: its old home
from bayesncl_pyro.infer.checks import check_rows, checked_prior
from bayesncl_pyro.infer.density import DensityControl, check_gate_density
from bayesncl_pyro.infer.elbo import ELBOTerms
from bayesncl_pyro.infer.elbo import own_params as own_params  # re-exported: its old home
from bayesncl_pyro.infer.estimators import GateEstimator, gate_class
from bayesncl_pyro.infer.evaluation import HeadEvaluation
from bayesncl_pyro.infer.output import HeadOutput
from bayesncl_pyro.infer.output import gate_pulls as gate_pulls  # re-exported: its old home
from bayesncl_pyro.infer.program import HeadProgram
from bayesncl_pyro.models.bayesncl import ContrastiveModel, computed, gate_site
from bayesncl_pyro.models.priors import Prior
from bayesncl_pyro.nn.encoders import mlp
from bayesncl_pyro.nn.losses import REFERENCE_KL_CLAMP

logger = logging.getLogger(__name__)


class BayesNCLHead(HeadProgram, HeadEvaluation, nn.Module):
    """Backbone features of 2B view-rows -> (loss, monitoring values).

    The arguments are named as the command-line flags of ``experiments/run_svi.py``; the defaults are the published
    CIFAR recipe's. Each is checked when the head is built (``infer/checks.py``): a bad value is one
    :class:`~bayesncl_pyro.errors.UserError` naming the argument and the fix.

    Args:
        in_dim: D, the width of the backbone's features h (2048 for a ResNet-50 without its ``fc``).
        proj_dim: K, the number of features the projector gives and of gates, one per feature (default 256).
        proj_hidden: the hidden width of the projector's 2-layer MLP and of the gating head (default 2048).
        num_train: N, the number of images in the training set (at least 2): the ELBO's rows plate is 2N view-rows,
            and each batch is scaled up to it; pass ``len(train_set)``.
        prior: the prior over the gates: a registry name of :data:`~bayesncl_pyro.models.priors.PRIORS`
            (``bernoulli``, the default and the paper's; ``learned``, ``beta-bernoulli``, ``ibp``, ``logit-normal``,
            ``per-image``), ``package.module:Class``, a built :class:`~bayesncl_pyro.models.priors.Prior` of
            ``proj_dim`` gates, or None for NCL (and with ``nonneg="none"``, SimCLR): no gates, no latent variables.
        prior_prob: rho, the prior's inclusion rate in (0, 1), or for a prior with a hyperprior its mean (default
            0.8, the published rate); used when ``prior`` is given by name.
        prior_args: the other constructor arguments of a prior given by name (``--prior-arg name=value``), e.g.
            ``{"concentration": 10.0}`` for ``beta-bernoulli``; None for none.
        kl_weight: lambda > 0, the weight of the KL term in the ELBO (the temperature of the Gibbs posterior; default
            3e-5, the published value). It stays this value with ``gate_density``, which has a multiplier of its own.
        kl_clamp: c in [0, 0.5): the KL is taken at the rates clamped to [c, 1 - c] (default 0.01, the reference's;
            0 is the exact KL).
        gate: how training differentiates through the discrete gates, a name of
            ``bayesncl_pyro/infer/estimators.py``'s ``GATES`` (``ste``, the default and the reference's surrogate;
            ``relaxed``, ``st-sampled``, ``leg``, ``gs``, ``gs-reference-kl``); it also picks q's family.
        gate_temperature: the temperature of q's relaxation, for the estimators whose family has one (``relaxed``,
            ``gs``, ``gs-reference-kl``; default 1.0).
        head_depth: the number of linear layers of the gating head, the MLP that maps h.detach() to the gates' logits
            (default 2).
        logit_bound: the gates' logits are squashed smoothly into (-bound, bound), so a saturated gate still gets a
            gradient and can come back (default 5.0).
        temperature: tau, InfoNCE's temperature (default 0.2, the reference's).
        nonneg: how the features are made non-negative: ``rep_relu`` (the default: ReLU forward, GELU's gradient
            backward), ``relu``, or ``none`` (SimCLR's features).
        topk: keep only the k largest features of each row, in [0, ``proj_dim``] (default 0: all of them).
        gather_distributed: under ``torch.distributed`` with several ranks, contrast each row against the rows of
            every rank (global negatives); a run on one process is unaffected (default False).
        gate_density: D in (0, 1), a target share of open gates: a constraint on the share of the evaluation mask's
            gates that are open, with a Lagrange multiplier of its own, stepped by :meth:`update_density` after every
            training step; lambda is unchanged (``bayesncl_pyro/infer/density.py``). None (the default): no target.
            It needs a prior.
        gate_head: the gating head: ``mlp`` (the default, the reference's: weights as point estimates) or
            ``bayesian`` (latent weights with a prior and a mean-field Normal q, ``guides.gates.BayesianHead``).

    The prior's global parameters get their gradient divided by lambda (``nn/gradient_scale.py``). ``kl_kind``:
    how the ELBO takes each latent site's KL (``infer/kl.py``), logged once at DEBUG when the head is built. A forward
    pass changes nothing of the head. With ``gate_density``, a training loop calls :meth:`update_density` with the
    step's output after ``optimizer.step()``: that moves the constraint's multiplier. For Pyro's ``SVI``:
    :meth:`svi_program` and :meth:`elbo`.

    Examples:
        >>> head = BayesNCLHead(64, proj_dim=16, proj_hidden=32, num_train=100)  # the bernoulli prior, rho = 0.8
        >>> h = torch.rand(8, 64)  # backbone features of 4 images' two views, [view 1; view 2]
        >>> loss, out = head(h)
        >>> loss.backward()
        >>> head.representation(h).shape, head.gate_mask(h).shape  # R x K
        (torch.Size([8, 16]), torch.Size([8, 16]))
        >>> [group["name"] for group in head.param_groups(lr=0.3)]  # the bernoulli prior has no parameters
        ['encoder', 'gate_head']
    """

    def __init__(self, in_dim: int, proj_dim: int = 256, proj_hidden: int = 2048, *, num_train: int,
                 prior: str | Prior | None = "bernoulli", prior_prob: float = 0.8, prior_args: dict | None = None,
                 kl_weight: float = 3e-5, kl_clamp: float = REFERENCE_KL_CLAMP, gate: str = "ste",
                 gate_temperature: float = 1.0, head_depth: int = 2,
                 logit_bound: float = 5.0, temperature: float = 0.2, nonneg: str = "rep_relu", topk: int = 0,
                 gather_distributed: bool = False, gate_density: float | None = None, gate_head: str = "mlp"):
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
            row_latents=prior.row_latents, gate_head=gate_head,
        ) if prior is not None else None
        if self.guide is not None and self.guide.bayesian:
            self.model.head_prior = self.guide.head_prior
        self.gather_distributed = gather_distributed
        self.density = None
        if gate_density is not None:
            if prior is None:
                raise UserError("gate_density is a target share of open gates; a head without a prior (NCL, CL) has "
                                "no gates: drop gate_density or give a prior")
            check_gate_density(gate_density, "bayesncl")
            self.density = DensityControl(gate_density)
        self.kl_kind = self._kl_kinds(in_dim)
        for site, kind in self.kl_kind.items():  # run_svi.py says them in its first lines
            logger.debug(f"the KL of latent site {site!r}: {kind}")

    @property
    def gated(self) -> bool:
        """Whether the head has gates (a prior), not NCL or CL."""
        return self.guide is not None

    @property
    def num_rows(self) -> int:
        """2N, the view-rows of the training set: the rows plate's size."""
        return self.model.num_rows

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, HeadOutput]:
        """One training step's loss and what it computed, from the backbone's features of a batch.

        Nothing of the head changes: with a density target, call :meth:`update_density` after the optimizer step.

        Args:
            h: R x D backbone features of the rows ``[view 1 of B images; view 2 of the same B images]`` (R = 2B,
                at least 4 rows on one process, at most 2N).

        Returns:
            ``(loss, out)``: the 0-d loss training minimises, ``-ELBO / 2N`` as the gate estimator estimates it (for
            ``ste`` and ``gs-reference-kl`` the reference's surrogate instead: :attr:`objective`), plus with
            ``gate_density`` the constraint's term, of value 0; and what the step computed (:class:`HeadOutput`).
        """
        check_rows(h, self.num_rows, self.gather_distributed and distributed.world_size() > 1, self.estimator)
        z = self.projector(h)  # under the caller's autocast, if any
        dtype = self.projector[0].weight.dtype
        kl_weight = self.kl_weight
        # the Pyro program in full precision under the caller's autocast, its exps and logs, but the gating MLP, a
        # matmul of the projector's size, under it as the projector; without one nothing is entered (on a CPU step,
        # entering autocast costs more than the program's small ops)
        device = h.device.type
        mlp_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        with torch.autocast(device, enabled=False) if mlp_dtype is not None else contextlib.nullcontext():
            gather = distributed.gather_rows if self.gather_distributed else None
            terms = self.elbo_terms(z.to(dtype), h.to(dtype), gather, kl_weight=kl_weight, mlp_dtype=mlp_dtype)
        made = computed(terms.model_trace)
        gated, loss = {}, terms.loss
        if self.gated:
            # the tensor whose gradient is InfoNCE's alone: the gates, for leg the probabilities its ELBO used
            site = gate_site(terms.model_trace)
            gates = site["value"] if terms.gate_probs is None else terms.gate_probs
            if gates.requires_grad:
                gates.retain_grad()  # read by pulls() after backward
            q = terms.guide_trace.nodes[site["name"]]["fn"].base_dist
            gated = dict(kl_weight=kl_weight, gates=gates, q=q, prior=site["fn"], estimator=self.estimator)
            if self.density is not None:  # the constraint's term, of value 0: the loss stays the head's
                loss = loss + self.density.term(self.estimator.mask_probs(q))
                gated["density_multiplier"] = self.density.multiplier()
        return loss, HeadOutput(nce=made["row_nce"].mean(), kl=terms.kl, features=made["features"], **gated)

    @property
    def kl_weight(self) -> torch.Tensor | float:
        """lambda, the KL's weight: the constructor's ``kl_weight`` (a density target has a multiplier of its own)."""
        return self.model.kl_weight

    @torch.no_grad()
    def update_density(self, out: HeadOutput | torch.Tensor):
        """With a density target, one dual step of the constraint's multiplier from a training step's output.

        The target is ``gate_density``. Call it once per training step, after ``optimizer.step()``; the next step's
        loss carries the new multiplier. Without a target it does nothing.

        Args:
            out: the step's :class:`HeadOutput` (the second value :meth:`forward` returns), whose share of open gates
                of the evaluation mask on the batch the step reads; or, for Pyro's ``SVI``, which returns no output,
                that share itself as a 0-d tensor, ``head.gate_mask(h).float().mean()``.
        """
        if self.density is not None:
            self.density.update(out.gates_open if isinstance(out, HeadOutput) else out)

    @property
    def objective(self) -> str:
        """What the loss computes, in words: the gate estimator's objective, or for NCL and CL the InfoNCE alone."""
        return self.estimator.objective if self.gated else "InfoNCE per row (no latent variables: -ELBO = InfoNCE)"

    def elbo_terms(self, z: torch.Tensor, h: torch.Tensor, gather=None, estimator: GateEstimator | None = None,
                   family=None, kl_weight=None, mlp_dtype=None) -> ELBOTerms:
        """The one place the head's Pyro program runs in training: loss, KL per row, traces.

        The diagnostics run the program here too, passing another gate ``estimator`` and q ``family``. It runs inside
        :func:`own_params`, so no parameter reaches Pyro's global param store.

        Args:
            z: R x K projector outputs of the rows.
            h: R x D backbone features of the same rows (the gating head reads them).
            gather: None, or ``distributed.gather_rows`` for every rank's rows as negatives (:meth:`program`).
            estimator: the gate estimator; None (the default): the head's.
            family: q's family of the gates; None (the default): the guide's.
            kl_weight: the step's lambda; None (the default): :attr:`kl_weight`.
            mlp_dtype: the autocast dtype of the gating MLP (:meth:`training_program`'s); None: no autocast.

        Returns:
            The ELBO's :class:`ELBOTerms`: the loss (:meth:`forward`'s, -ELBO / 2N as the estimator estimates it), its
            KL term per row (detached, divided by lambda), and the model's and guide's traces, where what the program
            computed is read, with the ELBO's per-site figures.
        """
        kl_weight = self.kl_weight if kl_weight is None else kl_weight
        model, guide = self.training_program(estimator, gather, kl_weight, family, mlp_dtype)
        with own_params():
            terms = self.elbo(estimator).terms(model, guide, z, h)
        return terms._replace(loss=terms.loss / self.num_rows, kl=terms.kl / (self.num_rows * kl_weight))

    def _kl_kinds(self, in_dim: int) -> dict[str, str]:
        """How the ELBO takes each latent site's KL (``infer.kl``), from one run of the program on rows of zeros.

        On a forked random stream, without gradients: building a head draws nothing and trains nothing. This first run
        also sets up an autoguide of the prior's latents (its parameters exist from its first call), before an
        optimizer is given the head's parameters.
        """
        if not self.gated:
            return {}
        h = torch.zeros(4, in_dim)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            return self.elbo_terms(self.projector(h), h).kl_kind

    def param_groups(self, lr: float, gate_lr: float = 0.1, backbone: nn.Module | None = None) -> list[dict]:
        """Optimizer groups: encoder, gating head and the prior's global parameters.

        Clip gradients by group: the prior's are not on the loss's scale.

        Args:
            lr: the learning rate of the encoder group, the backbone (if given) and the projector.
            gate_lr: the learning rate of the gating head (0.1 published, not batch-scaled) and of the prior's global
                parameters (default 0.1).
            backbone: the backbone, whose parameters join the encoder group; None (the default): the projector alone.

        Returns:
            A list of ``torch.optim`` parameter groups, each with a ``name``: ``encoder`` at ``lr``; with gates,
            ``gate_head`` at ``gate_lr``; and for a prior with parameters ``prior`` at ``gate_lr`` without weight
            decay, their gradients divided by lambda (``nn/gradient_scale.py``; its ``grad_scale`` records by what,
            and marks a checkpoint of this scheme).
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
        """The prior's global parameters, the prior's and its guide's: their ``.grad`` is divided by lambda.

        Returns:
            The parameters of the prior and of its guide of global latents, a list; empty for NCL and CL and for a
            prior with none (``bernoulli``).
        """
        if not self.gated:
            return []
        rate_guide = self.guide.rate_guide
        return [*self.model.parameters(), *(rate_guide.parameters() if rate_guide is not None else ())]

    def __getstate__(self):
        state = super().__getstate__().copy()
        state.pop("_trained", None)  # a copy builds its own, around its own guide
        return state
