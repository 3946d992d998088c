"""The prior's global parameters learn at a step that does not depend on lambda: their gradients divided by it.

Their whole objective sits inside the lambda-weighted KL, so the loss's gradient on them is lambda times theirs. A
hook on each (``BayesNCLHead._unweight``) divides it by the step's lambda, read at backward time, so a density
target's moving multiplier is followed; the division is on the gradient, not the learning rate, so that it holds under
any optimiser (with Adam, scale-free, a learning rate of gate_lr / lambda would step lambda-fold too far).
"""

import weakref

from torch import nn

from bayesncl_pyro.errors import UserError

# the heads that hook prior parameters, for the refusal of a prior that another head's hook divides already
_HEADS: weakref.WeakSet = weakref.WeakSet()


def unweight_prior_gradients(head):
    """Hook the head's ``_unweight`` onto every prior parameter it has not hooked, keeping the handles.

    Called at construction and at every step: a tensor hook does not travel with a deep copy, a pickle, or a module
    conversion that replaces the parameter, and neither does the record of the handles (``BayesNCLHead.__getstate__``),
    so a copy hooks its own parameters at its first step. A prior hooked by another head is refused: its gradients
    would be divided twice.
    """
    params = head.prior_parameters()
    if len(params) == len(head._unweighted) and all(divides(head, p) for p in params):
        return  # every step but the first of a head or a copy: nothing to hook
    hooked = {}
    for p in params:
        if not p.requires_grad:
            continue
        old = head._unweighted.get(id(p))  # (parameter, handle): the parameter held, so its id stays its own
        if old is None or old[0] is not p:
            if any(divides(other, p) for other in _HEADS):
                raise UserError("this prior belongs to another BayesNCLHead already (its gradients are divided by "
                                "lambda there); build a new prior for this head")
            old = (p, p.register_hook(head._unweight))
            _HEADS.add(head)
        hooked[id(p)] = old
    head._unweighted = hooked


def divides(head, p: nn.Parameter) -> bool:
    """Whether ``head`` divides p's gradient."""
    return head._unweighted.get(id(p), (None,))[0] is p
