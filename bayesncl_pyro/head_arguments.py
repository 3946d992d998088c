"""The one check of :class:`~bayesncl_pyro.head.BayesNCLHead`'s arguments, below the head so that the config checks
its fields with it (``config.resolve``) without importing the head."""

from bayesncl_pyro.errors import UserError
from bayesncl_pyro.estimators import GATES
from bayesncl_pyro.losses import NONNEG

# the head's arguments that :func:`check_arguments` checks, with what to pass instead of a value that is not positive
_POSITIVE = dict(proj_dim="256", proj_hidden="2048", head_depth="2", temperature="0.2 (the reference's)",
                 gate_temperature="1.0", logit_bound="5.0",
                 kl_weight="3e-5 (the published lambda); for no gates at all, no prior (NCL)")
HEAD_ARGUMENTS = (*_POSITIVE, "kl_clamp", "gate", "nonneg", "topk")


def check_arguments(flags: bool = False, **args):
    """The one check of the head's arguments (``HEAD_ARGUMENTS``, named as the Config's fields): the head calls it,
    and ``config.resolve`` with ``flags=True``, which names them as run_svi.py's flags. A value that would give a
    wrong loss without a word (a clamp of 0.5 or more: a KL of exactly 0; a logit bound of 0: every gate closed)
    or fail deep inside Pyro is refused in one line that names the argument and the fix."""
    name = (lambda n: "--" + n.replace("_", "-")) if flags else (lambda n: n)  # noqa: E731
    for arg, valid in (("gate", tuple(GATES)), ("nonneg", NONNEG)):
        if args[arg] not in valid:
            raise UserError(f"unknown {name(arg)} {args[arg]!r}; choose one of: {', '.join(valid)}")
    for arg, example in _POSITIVE.items():
        if not args[arg] > 0:
            raise UserError(f"{name(arg)} must be positive, got {args[arg]}; pass e.g. {example}")
    if not 0 <= args["kl_clamp"] < 0.5:
        raise UserError(f"{name('kl_clamp')} must lie in [0, 0.5), got {args['kl_clamp']} (from 0.5 on the clamped "
                        "KL is 0): 0.01 is the reference's clamp, 0 the exact KL")
    if not 0 <= args["topk"] <= args["proj_dim"]:
        raise UserError(f"{name('topk')} must lie in [0, {name('proj_dim')}={args['proj_dim']}], got {args['topk']} "
                        "(0 keeps every feature)")
