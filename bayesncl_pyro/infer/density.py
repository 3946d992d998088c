"""The gates' density as a constraint: share of open gates = D, with a Lagrange multiplier of its own.

A hand-picked lambda does not say how many gates stay open (3e-5 and 0.1 differ by 3,000x between recipes that
both work). ``--gate-density D`` states the density instead: training minimises the head's loss
(``models/bayesncl.py``, lambda the user's ``--kl-weight``, fixed) subject to ``share = D``, through the Lagrangian
``loss + mu * K * (share - D)``; mu, the constraint's multiplier, is found by dual ascent after every step
(constrained L0 sparsity, Gallego-Posada et al. 2022). The constraint does not go through the prior: lambda weighting
the KL was the multiplier before, and a prior that learns its rates follows q, its KL shrinks, and lambda had no
lever (over ten seeds at D = 0.3 the ibp prior met D on none). mu prices the gates themselves, whatever the prior,
as long as the prior's pull on the gates stays a small part of InfoNCE's: a KL that outpulls it closes gates early,
and a closed gate has no InfoNCE gradient left to reopen it; a KL half as strong as InfoNCE can still take up the
multiplier's whole push (:func:`prior_holds_the_gates`).

Which share. The constraint's value, which the dual step reads, is the share of open gates of the *evaluation mask*
(q's mode 1[q(g = 1 | x) > 0.5]; for ``gs-reference-kl`` the reference's mask, ``GateEstimator.mask``): the share
of the representation F that every metric judges, so the comparison at matched density is at D. Its gradient, which
the primal step follows, is that of E_q[open fraction] = mean(q(g = 1 | x)) (of the probabilities the mask
thresholds): for ``ste`` exactly the straight-through gradient of the mode that training sees (its gates' value is
``mode + p - sg(p)``), for the sampled estimators the exact gradient of their draws' expected share. A step function
has no gradient of its own, so the dual reads the true constraint and the primal a smooth one with the same
direction: a proxy constraint (Cotter et al. 2019, "Two-player games for efficient non-convex constrained
optimization"; Cooper's ``strict_violation``). The log records the batch's share (``gates_open``), E_q's
(``gate_rate``), the target on its path (``density_target``) and mu (``density_multiplier``).

Its sign. An equality constraint: mu is unbounded and negative when too few gates are open (it then pays for
opening them). Nothing depends on the prior's rate or on which side of 1/2 it lies.

Its units. The term added to the loss is ``mu * sum_k mean_i (p_ik - sg(p_ik))``: of value 0, so the loss the log
reports stays the head's, and its gradient is mu per gate per row, the units of the log's ``gate_nce_pull`` (the
mean |gradient| of InfoNCE per row on one gate): a gate stays open where InfoNCE pulls it harder than mu.

The target's path. Gates that have closed do not reopen readily when mu falls again (a gate gated off gets no
InfoNCE gradient and its feature fades), so an overshoot below D is nearly for good. The target therefore starts at
the first step's share and moves to D geometrically, target_t = D + (target_{t-1} - D) * exp(-1 / RAMP_STEPS), a
path the gates can follow; the multiplier is a PI controller of the error e = share - target: mu = mu_I + DUAL_P * e,
mu_I += DUAL_LR * e (the integral alone is plain dual ascent; Sohrabi et al. 2024, "On PI controllers for updating
Lagrange multipliers"). mu_I, e and the target are buffers: they travel with the state_dict, and a resumed run takes
the same steps.

Why our own dual ascent, not the ``cooper-optim`` library (1.0). Cooper states the same method (a
``ConstrainedMinimizationProblem`` whose ``Constraint`` has a multiplier, a ``ConstraintState`` with a
``strict_violation`` for proxy constraints, dual optimisers including a PI controller), but its
``ConstrainedOptimizer`` takes the primal step too (``roll``: zero_grad, the Lagrangian's backward, the primal and
dual steps): it would own the loop's optimizer step, which here the divergence guard wraps and can undo, a CUDA graph
captures, DDP averages, and a user's own loop takes (``update_density(out)`` after ``optimizer.step()`` is the head's
whole contract with a loop). One scalar multiplier is twenty lines here, on the device without a host sync, averaged
over the ranks; a dependency that brings its own training loop is not worth them.
"""

import math

import torch
import torch.distributed as dist
from torch import nn

from bayesncl_pyro.errors import UserError

DUAL_LR = 0.001
"""The integral gain: the step of mu_I per unit of the share's error, in loss per gate per row. The multiplier a
compositional run needs is small (|mu| below 0.003, against InfoNCE's pull of about 0.04 per gate), because it moves
every gate's logit at once and the gates' logits lie close together early on (probabilities 0.47 to 0.55 at step 30):
20 times these gains (0.02, 0.5) swung the batch share between 0.09 and 0.81 (seed 0, D = 0.3)."""
DUAL_P = 0.05
"""The proportional gain: mu = mu_I + DUAL_P * (last step's share - its target). The gating head integrates mu (its
logits move while mu lasts) and answers late (its momentum): the proportional part brakes before the integral has wound
up."""

RAMP_STEPS = 40.0
"""The target's time constant in steps: it covers 63 % of the way from the first share to D in RAMP_STEPS steps and
99 % in 5 times that (a compositional run has 225 steps; runs on real data have thousands)."""
RAMP_DECAY = math.exp(-1.0 / RAMP_STEPS)


def check_gate_density(density: float | None, method: str):
    """Refuse a --gate-density that cannot be met, in one line naming the fix."""
    if density is None:
        return
    if method != "bayesncl":
        raise UserError(f"--gate-density sets the share of open gates, and --method {method} has no gates; drop "
                        "--gate-density or use --method bayesncl")
    if not 0.0 < density < 1.0:
        raise UserError(f"--gate-density is a share of open gates and must lie strictly between 0 and 1, got {density}")


TOLERANCE = 0.05
"""How far from D the test split's share of open gates may end before the run says it missed the target."""


def shortfall(density: float | None, share: float | None, last: dict | None = None) -> str | None:
    """The warning for a run whose test share of open gates missed its --gate-density, or None.

    One warning line when the test split's share of open gates ended more than TOLERANCE from D, saying why and what
    to change; None when it met D (or had no target). The multiplier holds the training batches' share on the
    target's path; the test split's can still differ when the run ended before the path reached D (about
    5 * RAMP_STEPS steps), or when the gates closed below D and did not reopen. ``last``: the run's last log record
    (its ``gate_nce_pull``, ``gate_prior_pull``, ``density_multiplier`` and ``kl_weight``), which tells when the prior
    is the cause (:func:`prior_holds_the_gates`): the KL closes gates faster than the multiplier, which raises every
    gate's probability alike, opens them, and the gates settle where the two balance, below 1/2, the mode shut (at
    lambda 0.3 on the compositional recipe every gate closed within 10 steps under ``ste`` and under ``leg``).
    """
    if density is None or share is None or abs(share - density) <= TOLERANCE:
        return None
    more_steps = f"train for more steps (--epochs), the target's path to D takes about {5 * RAMP_STEPS:g} steps"
    if share >= density:
        why, fix = "the multiplier had not closed enough gates by the last step", more_steps
    elif last and (held := prior_holds_the_gates(last)):
        at = f" at --kl-weight {last['kl_weight']:g}" if "kl_weight" in last else ""
        why = f"the prior's pull on the gates{at} {held[0]} at the last logged step: {held[1]}"
        fix = ("lower --kl-weight until log.jsonl's gate_prior_pull is a small part of its gate_nce_pull (a tenth met "
               "D on every seed of the compositional recipe)")
    else:
        why = ("gates that closed on the way to D did not reopen (a closed gate gets no InfoNCE gradient) or the "
               "run ended before the multiplier brought the share back")
        fix = (f"{more_steps}; where log.jsonl's gate_prior_pull nears its gate_nce_pull, the prior is closing them: "
               "lower --kl-weight")
    return (f"warning: the test split's share of open gates is {share:.3f}, not --gate-density {density:g} (more "
            f"than {TOLERANCE:g} away): {why}; {fix}")


def prior_holds_the_gates(last: dict) -> tuple[str, str] | None:
    """How the prior's pull held the gates shut at a log record (the pulls, what followed), or None where it does not.

    The prior is the cause where its pull on the gates (``gate_prior_pull``) outweighs InfoNCE's (``gate_nce_pull``),
    or where the multiplier pushes the gates open (mu < 0) and the prior pulls back with at least half that push: the
    multiplier's force then goes to the prior, not to the gates' choice. The two are in the same units (loss per gate
    per row; module docstring). Under ``leg`` at lambda 0.3 (compositional, five seeds) InfoNCE's pull stayed twice the
    prior's while the prior matched |mu| (0.085-0.098 against 0.086-0.090) and every gate's probability sat near 0.25.
    """
    prior, nce, mu = last.get("gate_prior_pull"), last.get("gate_nce_pull", 0.0), last.get("density_multiplier")
    if prior is None:
        return None
    if prior >= nce:
        return (f"outweighed InfoNCE's (gate_prior_pull {prior:.3g} against gate_nce_pull {nce:.3g})",
                "the KL closes the gates faster than the multiplier opens them, and a closed gate gets no InfoNCE "
                "gradient")
    if mu is not None and mu < 0 and prior >= -mu / 2:
        return (f"took up the multiplier's push to open them (gate_prior_pull {prior:.3g} against "
                f"|density_multiplier| {-mu:.3g}; gate_nce_pull {nce:.3g})",
                "the gates settle where the two balance, below 1/2, and the mode that the share counts reads them shut")
    return None


class DensityControl(nn.Module):
    """The multiplier mu of the constraint ``share of open gates = density``, and its term of the loss.

    mu = mu_I + DUAL_P * error (module docstring); mu_I, the last step's error and the target's path are buffers, so
    they travel with the learner's state_dict and a resumed run continues the same sequence of multipliers.

    Args:
        density: D, the target share of the evaluation mask's open gates.
    """

    def __init__(self, density: float):
        super().__init__()
        self.density = density
        self.register_buffer("integral", torch.tensor(0.0))  # mu_I
        self.register_buffer("error", torch.tensor(0.0))  # the last step's share - target
        self.register_buffer("target", torch.tensor(float("nan")))  # the last step's target; NaN before the first

    def multiplier(self) -> torch.Tensor:
        """mu, 0-d, in loss per gate per row: a new tensor, so the step that uses it keeps its value after update."""
        return self.integral + DUAL_P * self.error

    def term(self, probs: torch.Tensor) -> torch.Tensor:
        """The constraint's term of the loss: ``mu * sum_k mean_i (p_ik - sg(p_ik))``, of value 0.

        ``probs``: R x K, the probabilities whose threshold at 1/2 is the evaluation mask
        (``GateEstimator.mask_probs``); the term's gradient is mu times that of K * E_q[open fraction].
        """
        return self.multiplier().to(probs.dtype) * (probs - probs.detach()).sum(-1).mean()

    @torch.no_grad()
    def update(self, share: torch.Tensor):
        """One dual step from this step's share of open gates (the evaluation mask's, on the batch).

        The share is 0-d and stays on the device (no host sync); the step is taken against the target's next point on
        its path to the density. Under DDP the ranks' shares are averaged, so every rank keeps the same multiplier. A
        non-finite share (a step the divergence guard will judge) leaves the multiplier as it is.
        """
        share = torch.as_tensor(share, device=self.integral.device).detach().float()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            share = share.clone()
            dist.all_reduce(share)
            share /= dist.get_world_size()
        finite = torch.isfinite(share)
        start = torch.where(torch.isnan(self.target), share, self.target)  # the path starts at the first share
        self.target.copy_(torch.where(finite, self.density + (start - self.density) * RAMP_DECAY, self.target))
        error = share - self.target
        self.integral.add_(torch.where(finite, DUAL_LR * error, 0.0))
        self.error.copy_(torch.where(finite, error, self.error))

    def extra_repr(self) -> str:
        """The target density."""
        return f"density={self.density}"
