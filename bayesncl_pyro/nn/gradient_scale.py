"""A tensor whose gradient through one use is scaled, its value exact: the path along which the prior's are divided.

``models.bayesncl.scaled_call`` calls the prior and its guide with their parameters replaced by :func:`scale_grad` of
them, so the gradient that reaches a parameter along the head's program is divided by lambda, and the parameter itself
carries no hook.
"""

import torch


class _ScaleGrad(torch.autograd.Function):
    """The identity forward; backward, the incoming gradient times ``scale``."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.clone()  # not a view: an optimizer steps the parameter in place

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """x, whose gradient through this use is multiplied by ``scale`` (its value exactly x's)."""
    return _ScaleGrad.apply(x, scale)
