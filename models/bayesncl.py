"""The generative side: gates from the prior, InfoNCE on gated non-negative features as a likelihood factor.

The training set has N images, hence ``num_rows = 2N`` view-rows; a minibatch holds R = 2B of them.
Per row i, under ``pyro.plate("rows", 2N, subsample=R rows)`` (every site in it scaled by 2N / R):

* ``g_i ~ prior(rows)`` (K gates; for today's priors Bernoulli(rate)) sits under ``poutine.scale(lambda)`` in the
  model *and* the guide, so a mean-field ELBO subtracts lambda * KL(q(g_i | x_i) || p(g_i)): in training the
  Bernoulli KL with the estimator's clamp (``kl_clamp``; 0.01 as the reference, 0 = exact); for
  ``gs-reference-kl``, the reference's KL at sigmoid(l), which is not KL(q || p).

and once for the batch, *outside* the plate but with the plate's scaling 2N / R:

* ``pyro.factor("nce", -sum_i l_i)`` adds the rows' InfoNCE losses l_i as an unnormalised log-likelihood
  (exp(-l_i) is no density over x): the "ELBO" is the variational objective of a Gibbs posterior, not a
  bound on log p(x).

So ``-ELBO = 2N * [mean_i l_i + lambda * mean_i sum_k KL_ik] + lambda * KL(global latents)``, and the
trainer minimises ``-ELBO / 2N``: the paper's "InfoNCE + lambda * KL per row", plus the global latents' KL once
per data set. lambda is the temperature of a Gibbs posterior, or with ``--gate-density`` a Lagrange multiplier
(``bayesncl_pyro/infer/density.py``; the head passes its value as ``kl_weight``); the factor sits outside the rows
plate because InfoNCE couples the rows: docs/METHOD.md, "The Pyro program". The program says what is random; how
training differentiates through the gates is the inference's choice (``bayesncl_pyro/infer/estimators.py``).

NCL is this program without the gate site, and CL (SimCLR) also without non-negativity.
"""

import functools

import pyro
import torch
from pyro import poutine
from pyro.nn import PyroModule
from torch.func import functional_call

from bayesncl_pyro.models.priors import Prior
from bayesncl_pyro.nn.gradient_scale import scale_grad
from bayesncl_pyro.nn.losses import info_nce_rows, nonneg, normalize, topk_mask


def rows_plate(num_rows: int, batch_rows: int, device) -> pyro.plate:
    """The plate over view-rows: full size ``num_rows`` so sites are scaled by num_rows / batch_rows."""
    # the device named: without it Pyro builds a tensor at every plate only to find the default device
    return pyro.plate("rows", num_rows, subsample=_row_indices(batch_rows, device), device=device)


def images_plate(num_rows: int, batch_rows: int, device) -> pyro.plate:
    """The plate over images, half the rows': a prior's latent per image (``Prior.row_latents``), its views' shared."""
    return pyro.plate("images", num_rows // 2, subsample=_row_indices(batch_rows // 2, device), device=device)


def image_features(h: torch.Tensor) -> torch.Tensor:
    """B x D: each image's backbone features from its two views' rows (2B x D, ``[view 1; view 2]``).

    The mean of the two views' normalised features, which a guide of per-image latents reads.
    """
    half = h.shape[0] // 2
    return (normalize(h[:half]) + normalize(h[half:])) / 2


@functools.lru_cache(maxsize=16)
def _row_indices(batch_rows: int, device: torch.device) -> torch.Tensor:
    """``arange(batch_rows)``, the plate's subsample, built once per batch size and device.

    The model and the guide enter the plate at every step. Never an inference tensor, whatever mode the first call ran
    in.
    """
    with torch.inference_mode(False):
        return torch.arange(batch_rows, device=device)


class ContrastiveModel(PyroModule):
    """p(g) p(x | g) for one minibatch of projector outputs.

    Args:
        num_rows: view-rows in the whole training set (2 per image).
        temperature: InfoNCE tau.
        nonneg: ``relu`` | ``rep_relu`` | ``none`` (CL).
        topk: if > 0, keep only the k largest features per row (the NCL+TopK baseline).
        prior: a :class:`bayesncl_pyro.models.priors.Prior` for BayesNCL, None for NCL / CL (no gate site).
        kl_weight: lambda.

    ``head_prior``: None, or a callable that samples the latent weights of a Bayesian gating head from their prior
    (``guides.gates.GateGuide.head_prior``), called under lambda beside the prior's global latents.
    """

    def __init__(self, num_rows: int, temperature: float = 0.2, nonneg: str = "relu", topk: int = 0,
                 prior: Prior | None = None, kl_weight: float = 3e-5):
        super().__init__()
        self.num_rows, self.temperature = num_rows, temperature
        self.nonneg, self.topk = nonneg, topk
        self.prior, self.kl_weight = prior, kl_weight
        self.head_prior = None

    def features(self, z: torch.Tensor) -> torch.Tensor:
        """Projector output (R x K) -> the L2-normalised (non-negative, top-k) features, before gating."""
        z = nonneg(z, self.nonneg)
        if self.topk:
            z = z * topk_mask(z, self.topk)
        return normalize(z)

    def forward(self, z: torch.Tensor, h: torch.Tensor, gather=None, kl_weight=None, prior_grad_scale=None):
        """Sample the gates, gate the features and add the batch's InfoNCE factor.

        Rows are ``[view 1 of B images; view 2 of the same B images]``. The gates ``g ~ prior`` under lambda and the
        rows plate; the features ``u = normalize(features(z) * g)``; the factor ``nce``, ``-sum_i l_i`` scaled by
        2N / R.

        Args:
            z: R x K projector output.
            h: R x D backbone features (used by the guide only).
            gather: None, or under DDP this rank's rows -> (every rank's rows, the offset of ours), for global
                negatives (``bayesncl_pyro.distributed.gather_rows``).
            kl_weight: this call's lambda (default: the constructor's).
            prior_grad_scale: None, or a factor on the gradient into the prior's parameters through this call
                (``nn.gradient_scale``: the head's 1 / lambda).

        The factor ``nce`` is marked with the gates' draw, the features they gate and its temperature
        (:func:`likelihood_site`, :func:`gate_site`): an inference that differentiates it itself finds the gates so.

        Returns:
            What it computed, detached, for whoever reads the trace (:func:`computed`): ``row_nce``, the per-row
            InfoNCE (R); ``features``, the rows it saw (R x K); and with gates ``ungated``, the same rows before
            gating (R x K). A return value, not ``pyro.deterministic`` sites: each such site is a sample statement
            through every handler (``docs/PERFORMANCE.md``, the Pyro layer's cost), for values no term of the ELBO
            uses.
        """
        u = ungated = self.features(z)
        rows = u.shape[0]
        if self.prior is not None:
            with poutine.scale(scale=self.kl_weight if kl_weight is None else kl_weight):
                if self.head_prior is not None:
                    self.head_prior()
                plate = rows_plate(self.num_rows, rows, u.device)
                # global latents outside the plate, each row's gates inside it; a prior's latents per image in a plate
                # over the images, whose two views share them
                args = (rows, images_plate(self.num_rows, rows, u.device)) if self.prior.row_latents else (rows,)
                gates = scaled_call(self.prior, prior_grad_scale, *args)
                with plate:
                    g = pyro.sample("g", gates)
            u = normalize(u * g)
        if gather is None:
            nce = info_nce_rows(u, self.temperature)
        else:
            columns, offset = gather(u)
            nce = info_nce_rows(u, self.temperature, columns, offset)
        # one factor for the batch: InfoNCE couples the rows (module docstring), scaled as the plate scales; marked
        # with what it is a function of, for an inference that differentiates it itself (leg: likelihood_site), the
        # gates' draw included (gate_site): a mark on the sample site itself would not survive replay against the
        # guide, whose site's infer dict replaces the model's
        mark = {} if self.prior is None else dict(info_nce=dict(gates=g, ungated=ungated.detach(),
                                                                 temperature=self.temperature))
        with poutine.scale(scale=self.num_rows / rows), poutine.infer_config(config_fn=lambda site: mark):
            pyro.factor("nce", -nce.sum())
        values = dict(row_nce=nce.detach(), features=u.detach())
        if self.prior is not None:
            values["ungated"] = ungated.detach()
        return values


def scaled_call(module: torch.nn.Module, scale, *args):
    """``module(*args)`` with the gradient into each of its parameters through this call multiplied by ``scale``.

    The prior's global parameters (and its guide's) enter the loss only inside the lambda-weighted KL, so their gradient
    is lambda times their objective's; the head calls them with 1 / lambda, so they learn at a step that does not
    depend on lambda under any optimiser (with Adam, scale-free, a learning rate of gate_lr / lambda would step
    lambda-fold too far). The parameters are left alone: a gradient the user takes of them elsewhere is the plain one.
    ``torch.func.functional_call`` with each parameter replaced by ``nn.gradient_scale.scale_grad`` of it, with Pyro's
    module-local parameters (a PyroParam is read from the module, never from the param store) and its param
    statements hidden (``SVI`` steps the parameters themselves, which ``pyro.module`` declares, not their scaled
    copies). None (or a module of no parameters): called as it is.
    """
    params = dict(module.named_parameters())
    if scale is None or not params:
        return module(*args)
    with pyro.settings.context(module_local_params=True), poutine.block(hide_types=["param"]):
        return functional_call(module, {name: scale_grad(p, scale) for name, p in params.items()}, args)


def gate_site(model_trace) -> dict:
    """The gate site of a model's trace: the one whose draw its InfoNCE factor is a likelihood of.

    An inference that treats the gates apart (the head's monitoring, ``leg``'s ELBO, the gradient-bias study) finds
    them so, not by a site name: a model of its own names its sites as it likes, and a handler may rename them
    (``pyro.contrib.autoname.scope``). The site of the same name in a guide's trace is q's.
    """
    gates = likelihood_site(model_trace)["infer"]["info_nce"]["gates"]
    return next(site for site in model_trace.nodes.values() if site["type"] == "sample" and site["value"] is gates)


def likelihood_site(model_trace) -> dict:
    """The InfoNCE factor of a trace, found by its mark.

    ``site["infer"]["info_nce"]`` holds the gates' draw (``gates``), the features they gate (``ungated``, R x K,
    detached) and its ``temperature``; ``site["scale"]`` is its scale. Exactly one is expected; more, or none
    (a model without gates), is an error that says so.
    """
    sites = [site for site in model_trace.nodes.values() if site["type"] == "sample" and "info_nce" in site["infer"]]
    if len(sites) != 1:
        raise ValueError(f"the program marks {len(sites)} factors as its InfoNCE (infer['info_nce']); one is expected")
    return sites[0]


def computed(model_trace) -> dict[str, torch.Tensor]:
    """What a trace of :class:`ContrastiveModel` computed (its return value).

    That is ``row_nce``, ``features`` and, with gates, ``ungated`` (:meth:`ContrastiveModel.forward`).
    """
    return model_trace.nodes["_RETURN"]["value"]
