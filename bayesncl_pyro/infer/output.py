"""What one step of the head computed (:class:`HeadOutput`), and how hard likelihood and prior pull the gates."""

import dataclasses
import functools

import torch
from torch.distributions import Distribution

from bayesncl_pyro._deprecated import renamed
from bayesncl_pyro.guides.gates import BernoulliGates
from bayesncl_pyro.infer.estimators import GateEstimator
from bayesncl_pyro.models.priors import gate_rates
from bayesncl_pyro.nn.losses import ACTIVE_EPS, bernoulli_kl_grad


@dataclasses.dataclass(eq=False)
class HeadOutput:
    """What one step of the head (:meth:`BayesNCLHead.forward`) computed, detached but ``gates``.

    The 0-d values stay on the device: ``.item()`` them when you log. The summary figures (the properties) are computed
    from the step's tensors when first read, then kept; read them before anything writes into those tensors (the head
    never does).

    Examples:
        >>> head = BayesNCLHead(64, proj_dim=16, proj_hidden=32, num_train=100)
        >>> loss, out = head(torch.rand(8, 64))  # backbone features of 4 images' two views, [view 1; view 2]
        >>> out.features.shape, out.probs.shape, out.nce.shape  # R x K, R x K, 0-d
        (torch.Size([8, 16]), torch.Size([8, 16]), torch.Size([]))
        >>> 0 <= out.gate_rate.item() <= 1
        True
    """

    nce: torch.Tensor
    """0-d: the mean InfoNCE per row at the gates training used."""
    kl: torch.Tensor
    """0-d: the KL term per row (summed over the gates, averaged over the rows; plus a prior's global latents' KL /
    2N); 0 without gates."""
    features: torch.Tensor
    """R x K: the rows InfoNCE saw."""
    kl_weight: torch.Tensor | float | None = None
    """With gates: this step's lambda, the KL's weight."""
    gates: torch.Tensor | None = None
    """With gates, R x K: the tensor InfoNCE's gradient reaches, the gate values (for ``leg`` the inclusion
    probabilities its ELBO used), whose gradient :meth:`BayesNCLHead.pulls` reads after ``loss.backward()``."""
    q: BernoulliGates | None = None
    """With gates: q(g | x) of the step's rows."""
    prior: Distribution | None = None
    """With gates: p(g) of the step's rows (for a hierarchical prior, at this step's draw of its global latents)."""
    estimator: GateEstimator | None = None
    """With gates: the gate estimator that trained the step."""
    density_multiplier: torch.Tensor | None = None
    """With a density target, 0-d: the step's multiplier mu of the constraint on the share of open gates."""

    def unread(self) -> "HeadOutput":
        """The same values with none of the summary figures computed yet.

        It is for tensors rewritten in place since this output was built (a CUDA graph's outputs,
        ``train/graph.py``).

        Returns:
            A new output of the same tensors.
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
        return gate_rates(self.prior)[0].detach()

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
