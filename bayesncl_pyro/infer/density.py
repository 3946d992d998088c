"""The gates' density as a target: lambda, the KL's weight, as a Lagrange multiplier found by dual ascent.

A hand-picked lambda does not say how many gates stay open (3e-5 and 0.1 differ by 3,000x between recipes that
both work). ``--gate-density D`` states the density instead: training minimises the head's loss
(``models/bayesncl.py``) subject to ``share = D``, and lambda is the constraint's multiplier, updated after every
step by dual ascent on the batch's share (the constrained formulation of controlled-sparsity and GECO-style training).

Which share. The share of open gates of the *evaluation mask* (the posterior mode, 1[q(g = 1 | x) > 0.5]; for
``gs-reference-kl`` the reference's mask): the share of the representation F that every metric judges. The mean
inclusion probability E[q(g = 1 | x)] would be the other choice, and under ``leg`` it is what the likelihood sees
on average; but a q whose probabilities sit near a sparse prior's rate has a mean of 0.2 and a mode that keeps
almost nothing, so a target on the mean would not fix the density of what is evaluated, which is what a
comparison at matched sparsity needs. Under ``ste`` the two coincide with what training sees (its forward pass
uses the mode). The log records both: ``gates_open`` (this share) and ``gate_rate`` (the mean probability).

Which way lambda pushes. The KL pulls q toward the prior's rate rho: with rho < 1/2 a larger lambda closes mode
gates (down to none), with rho > 1/2 it opens them (up to all). So the constraint is ``share <= D`` for rho < 1/2
and ``share >= D`` for rho > 1/2, and D is met exactly when the unconstrained share (InfoNCE's own, lambda -> 0)
lies on the other side of D; otherwise lambda shrinks step after step and the log shows the share staying on the
constraint's side. To make the published STE run sparser than its own share (about 0.55-0.65 at rho = 0.8 on the
compositional benchmark), use a prior below 1/2 (``--prior-prob 0.2``). A learned rate (``--prior learned``) follows
q, so the KL's pull has no fixed direction there; its direction is taken from the rate it starts at.

The target's path. Gates that the KL has closed do not reopen when lambda falls again (a dimension gated off
gets no InfoNCE gradient and its feature fades), so an overshoot below D is for good. The controller therefore
does not aim at D from the first step: its target starts at the first step's share and moves to D geometrically,
target_t = D + (target_{t-1} - D) * exp(-1 / RAMP_STEPS), a path slow enough for the gates to follow without
overshooting (RAMP_STEPS says what it measured). The log records it as ``density_target``.

Parametrisation. lambda = exp(eta + DUAL_P * e), e = s * (share - target) of the last step, eta += DUAL_LR * e,
s = +1 for rho < 1/2 and -1 above (dual ascent on eta, with a proportional term: DUAL_P says why): lambda
stays positive (it is a temperature: ``models/bayesncl.py``), and each step changes it by at most a factor
exp(DUAL_LR), whatever its scale; lambdas that work lie decades apart, which additive projected ascent on lambda
would cross either too slowly at 1e-5 or too coarsely at 1e-1. It starts at ``--kl-weight``.
"""

import math

import torch
import torch.distributed as dist
from torch import nn

from bayesncl_pyro.errors import UserError

DUAL_LR = 0.2
"""The integral gain: step of eta per unit of constraint violation; at a share 0.2 away from D, lambda changes by a
factor of 10 in about 60 steps (a compositional run has 225)."""
DUAL_P = 3.0
"""The proportional gain: log lambda = eta + DUAL_P * s * (last step's share - D) (a PI controller of the multiplier;
the integral term alone is plain dual ascent). The gates answer lambda late (the gating head's momentum) and, once
closed, do not reopen when lambda falls: on the compositional recipe (225 steps, D = 0.3, rho = 0.2, seed 0)
integral ascent alone kept raising lambda while the share was falling and ended at a batch share of 0.18 (ste) and
0.19 (leg), lambda back at its start; with this term, 0.205 and 0.234 on the test split; with the target's path as
well (RAMP_STEPS), docs/RESULTS.md, "At matched sparsity"."""

RAMP_STEPS = 40.0
"""The target's time constant in steps: it covers 63 % of the way from the first share to D in RAMP_STEPS steps and
99 % in 5 times that (a compositional run has 225 steps; runs on real data have thousands). Measured on the
compositional recipe at D = 0.3, seeds 0 and 1 (test-split share of open gates): leg 0.281 and 0.297, within 0.05;
ste 0.246 and 0.214, which follows the path to about step 110 and then closes gates by InfoNCE's own pull while
lambda falls; a larger DUAL_LR (0.5) made ste worse (0.195 by step 100)."""
RAMP_DECAY = math.exp(-1.0 / RAMP_STEPS)


def check_gate_density(density: float | None, method: str, prior_prob: float):
    """Refuse a --gate-density that cannot be met, in one line naming the fix."""
    if density is None:
        return
    if method != "bayesncl":
        raise UserError(f"--gate-density sets the share of open gates, and --method {method} has no gates; drop "
                        "--gate-density or use --method bayesncl")
    if not 0.0 < density < 1.0:
        raise UserError(f"--gate-density is a share of open gates and must lie strictly between 0 and 1, got {density}")
    if prior_prob == 0.5:
        raise UserError("--gate-density needs --prior-prob away from 0.5: the KL then pulls the posterior's mode "
                        "neither open nor closed; use e.g. 0.2 (the KL closes gates) or 0.8 (it opens them)")


def kl_closes_gates(prior_prob: float) -> bool:
    """Whether a larger lambda closes mode gates (rho < 1/2) rather than opening them ("Which way lambda pushes")."""
    return prior_prob < 0.5


TOLERANCE = 0.05
"""How far from D the test split's share of open gates may end before the run says it missed the target."""


def shortfall(density: float | None, prior_prob: float, share: float | None, learns_rates: bool = False) -> str | None:
    """The warning for a run whose test share of open gates missed its --gate-density.

    One warning line when a run's share of open gates on the test split ended more than TOLERANCE from its
    --gate-density, saying why and what to change; None when it met D (or had no target). The usual cause is D on
    the side of InfoNCE's own share that the prior's KL cannot reach (module docstring, "Which way lambda pushes"):
    the multiplier then falls towards 0 and the share stays where InfoNCE leaves it. With a prior that ``learns_rates``
    (parameters or latents of its own) neither reading holds: its rates move with q, so which way and how hard lambda
    pulls is not fixed by --prior-prob, and the KL can shrink whatever lambda is (``--prior ibp`` at D = 0.3, seed 0:
    lambda rose to 38 by the last step with 71 % of the test gates open and a KL of 0.05 nats per row; seed 1 closed
    all but 16 %).
    """
    if density is None or share is None or abs(share - density) <= TOLERANCE:
        return None
    closes = kl_closes_gates(prior_prob)
    if learns_rates:
        why = ("the prior learns its rates, which move with the gates' posterior, so lambda, the multiplier, does not "
               "set the share on its own (its KL can shrink whatever lambda is)")
        fix = "use a prior of fixed rates (bernoulli) with --gate-density, or leave it out and set --kl-weight"
    elif share < density if closes else share > density:
        why = (f"with --prior-prob {prior_prob:g} a larger lambda only {'closes' if closes else 'opens'} gates, so "
               f"lambda fell towards 0 and InfoNCE left {share:.3f} open")
        fix = (f"for D {'above' if closes else 'below'} that share, use a --prior-prob {'above' if closes else 'below'}"
               f" 0.5 (e.g. {'0.8' if closes else '0.2'}), whose KL {'opens' if closes else 'closes'} gates")
    else:
        why, fix = "the multiplier had not brought the share to D by the last step", "train for more steps"
    return (f"warning: the test split's share of open gates is {share:.3f}, not --gate-density {density:g} (more "
            f"than {TOLERANCE:g} away): {why}; {fix}")


class DensityControl(nn.Module):
    """lambda as the Lagrange multiplier of the constraint on the share of open gates.

    The multiplier lambda = exp(eta + DUAL_P * error) of the constraint ``share of open gates = density``; eta,
    error and the target's path are buffers, so they travel with the learner's state_dict and a resumed run
    continues the same sequence of lambdas.

    Args:
        density: D, the target share of the evaluation mask's open gates.
        kl_weight: lambda's starting value.
        prior_prob: the prior's rate rho (or its mean): which way a larger lambda moves the share (module docstring).
    """

    def __init__(self, density: float, kl_weight: float, prior_prob: float):
        super().__init__()
        self.density = density
        self.sign = 1.0 if kl_closes_gates(prior_prob) else -1.0
        self.register_buffer("eta", torch.tensor(float(kl_weight)).log())
        self.register_buffer("error", torch.tensor(0.0))  # the last step's s * (share - target)
        self.register_buffer("target", torch.tensor(float("nan")))  # the last step's target; NaN before the first

    def weight(self) -> torch.Tensor:
        """lambda, 0-d: a new tensor, so the step that uses it keeps its value after :meth:`update`."""
        return (self.eta + DUAL_P * self.error).exp()

    @torch.no_grad()
    def update(self, share: torch.Tensor):
        """One dual-ascent step on eta from this step's share of open gates.

        The share is 0-d and stays on the device (no host sync); the step is taken against the target's next point on
        its path to the density. Under DDP the ranks' shares are averaged, so every rank keeps the same lambda. A
        non-finite share (a step the divergence guard will judge) leaves the multiplier as it is.
        """
        share = share.detach().float()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            share = share.clone()
            dist.all_reduce(share)
            share /= dist.get_world_size()
        finite = torch.isfinite(share)
        start = torch.where(torch.isnan(self.target), share, self.target)  # the path starts at the first share
        self.target.copy_(torch.where(finite, self.density + (start - self.density) * RAMP_DECAY, self.target))
        error = self.sign * (share - self.target)
        self.eta.add_(torch.where(finite, DUAL_LR * error, 0.0))
        self.error.copy_(torch.where(finite, error, self.error))

    def extra_repr(self) -> str:
        """The target density and which way lambda moves the share."""
        return f"density={self.density}, sign={self.sign:+g}"
