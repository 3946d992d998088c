"""The head's arguments and prior, checked before anything is built: one line naming the argument and the fix.

:func:`check_arguments` checks the head's arguments by their names in ``BayesNCLHead``'s signature (or, with
``flags=True``, as run_svi.py's flags, for ``train.resolve``); :func:`checked_prior` builds the prior and checks it and
its guide against the program (``models.priors.checked_guide``). Both run before a run's folder is claimed.
"""

import os

import torch
from pyro.nn import PyroModule

from bayesncl_pyro.errors import UserError, quoted
from bayesncl_pyro.guides.gates import GATE_HEADS
from bayesncl_pyro.infer.estimators import GATES, GateEstimator, LocalExpectation
from bayesncl_pyro.models.priors import Prior, build_prior, checked_guide
from bayesncl_pyro.nn.losses import NONNEG

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
    for arg, valid in (("gate", tuple(GATES)), ("nonneg", NONNEG), ("gate_head", GATE_HEADS)):
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
    if args["gate_head"] != "mlp" and args["prior"] is None:
        raise UserError(f"{name('gate_head')} {args['gate_head']} is a head of the gates, and a head without a prior "
                        f"(NCL, CL) has none: drop {name('gate_head')} or give a prior (--method bayesncl)")
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
    if "_modules" not in vars(prior) or "num_features" not in vars(prior):  # nn.Module's and Prior's own set-up
        raise UserError(f"{type(prior).__name__}.__init__ did not call super().__init__(num_features, prior_prob), "
                        "which sets up the module and the prior's num_features and prior_prob: call it first")
    if prior.num_features != proj_dim:
        raise UserError(f"the prior has {prior.num_features} gates but the head {proj_dim} features; build the "
                        f"prior with num_features={proj_dim} (the head's proj_dim)")
    return prior, checked_guide(prior, in_dim)


def check_rows(h: torch.Tensor, num_rows: int, gathered: bool, estimator: GateEstimator | None):
    """Refuse a batch of backbone features h that the loss would get wrong without a word.

    Python integers only: no device sync. ``num_rows``: the head's 2N; ``gathered``: whether negatives come from
    other ranks too; ``estimator``: the head's.
    """
    if h.ndim != 2:
        raise UserError(f"the head takes R x D backbone features, got a tensor of shape {tuple(h.shape)}")
    rows = h.shape[0]
    if rows % 2:
        raise UserError(f"got {rows} rows, an odd number: the head takes the rows of both views of B images, "
                        "[view 1 of the B images; view 2 of the same B] (torch.cat([view1, view2]))")
    if rows < 4 and not gathered:
        raise UserError(f"got {rows} rows, the views of {rows // 2} image: InfoNCE needs another image for a "
                        "negative; pass a batch of at least 2 images (4 rows)")
    if isinstance(estimator, LocalExpectation) and gathered:
        raise UserError("--gate leg trains on one process only: its per-gate differences would need every rank's "
                        "rows and log-partitions, which are not gathered; run leg without torchrun, or train "
                        "with --gate st-sampled under DDP")
    if rows > num_rows:
        raise UserError(f"a batch of {rows // 2} images, but num_train={num_rows // 2}: num_train is the "
                        "number of images in the training set (the ELBO scales each batch up to it); pass "
                        "len(train_set)")
