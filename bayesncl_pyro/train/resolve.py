"""A Config made whole for training: its dataset's recipe filled in, and every value checked.

The values are checked against what the layers below register (datasets, encoders, the head's arguments, priors,
probes, devices).
"""

import dataclasses
import math
import os
from pathlib import Path

from bayesncl_pyro.config import (
    AUGMENT,
    EVAL_PROTOCOLS,
    METHODS,
    ON_NAN,
    OPTIMIZERS,
    RUNS,
    Config,
    run_name,
    with_recipe,
)
from bayesncl_pyro.data import DATASETS
from bayesncl_pyro.device import check_device
from bayesncl_pyro.errors import UserError, quoted
from bayesncl_pyro.evaluate.probe import REFERENCE_PROBES
from bayesncl_pyro.infer.density import check_gate_density
from bayesncl_pyro.infer.head import check_arguments, checked_prior
from bayesncl_pyro.infer.learner import head_arguments
from bayesncl_pyro.models.priors import prior_args
from bayesncl_pyro.nn.encoders import backbone_builder

FLOAT32_MAX, INT64_MAX = 3.4028234663852886e38, 2**63 - 1


def resolve(cfg: Config) -> Config:
    """Fill dataset defaults and check every value; raises :class:`UserError` naming the bad one.

    The run folder, when not given, is named by what the run is (:func:`run_name`).
    """
    _choice("dataset", cfg.dataset, DATASETS)
    cfg = with_recipe(cfg)
    for f in dataclasses.fields(cfg):
        value, flag = getattr(cfg, f.name), "--" + f.name.replace("_", "-")
        # NaN passes every comparison below, inf makes a run of NaN, and beyond float32 a step fails in torch
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
            raise UserError(f"{flag} must be a finite number of at most {FLOAT32_MAX:.4g} (float32), got {value}")
        if type(value) is int and abs(value) > INT64_MAX:  # gates.nc stores the config's integers as int64
            raise UserError(f"{flag} must be at most {INT64_MAX} (what a run's files store), got {quoted(value)}")
    _choice("method", cfg.method, METHODS)
    check_arguments(flags=True, **head_arguments(cfg))
    _choice("optimizer", cfg.optimizer, OPTIMIZERS)
    backbone_builder(cfg.encoder)  # imports what it names: a missing module fails here, before any training
    check_device(cfg.device)
    _choice("on_nan", cfg.on_nan, ON_NAN)
    _choice("augment", cfg.augment, AUGMENT)
    _choice("eval_protocol", cfg.eval_protocol, EVAL_PROTOCOLS)
    if cfg.eval_protocol == "reference" and cfg.dataset not in REFERENCE_PROBES:
        raise UserError(f"--eval-protocol reference is the paper's protocol for {', '.join(REFERENCE_PROBES)}, "
                        f"which does not include {cfg.dataset}; use --eval-protocol fast")
    check_gate_density(cfg.gate_density, cfg.method)
    _positive(cfg, "lr", "gate_lr", "image_size", "epochs", "log_every", "ckpt_every")
    # the prior's arguments as the types its constructor declares (so "5" and 5.0 resume the same run), then
    # the prior built and its guide checked as the head builds and checks them (it checks --prior-prob): they fail
    # now, before the run's folder is claimed and its data loaded
    cfg = dataclasses.replace(cfg, prior_args=prior_args(cfg.prior, cfg.prior_args))
    checked_prior(cfg.prior, cfg.proj_dim, cfg.prior_prob, cfg.prior_args)
    if cfg.batch_size < 2:
        raise UserError(f"--batch-size must be at least 2 (a contrastive loss needs negatives), got {cfg.batch_size}")
    if min(cfg.weight_decay, cfg.warmup_epochs, cfg.workers, cfg.conflict_every, cfg.monitor_every) < 0:
        raise UserError("--weight-decay, --warmup-epochs, --workers, --conflict-every and --monitor-every must not be "
                        "negative")
    if not 0 <= cfg.momentum < 1:
        raise UserError(f"--momentum must lie in [0, 1), got {cfg.momentum}")
    if not 0 <= cfg.seed < 2**31:  # the per-process seeds (seed + 1,000,003 x rank) must stay below numpy's 2**32
        raise UserError(f"--seed must be a whole number from 0 to {2**31 - 1}, got {cfg.seed}")
    if cfg.warmup_epochs >= cfg.epochs:
        raise UserError(f"--warmup-epochs ({cfg.warmup_epochs}) must be shorter than --epochs ({cfg.epochs})")
    if cfg.max_steps is not None and cfg.max_steps < 1:
        raise UserError(f"--max-steps must be at least 1, got {cfg.max_steps}")
    if cfg.ckpt_minutes is not None and not cfg.ckpt_minutes > 0:
        raise UserError(f"--ckpt-minutes must be positive, got {cfg.ckpt_minutes}")
    if cfg.out is None:
        cfg = dataclasses.replace(cfg, out=str(Path(RUNS) / run_name(cfg)))
    if cfg.data_dir is not None:  # as an absolute path: what opens the run later reads no relative one (rundir)
        cfg = dataclasses.replace(cfg, data_dir=os.path.abspath(os.path.expanduser(cfg.data_dir)))
    return cfg

def _choice(flag: str, value, valid):
    if value not in valid:
        raise UserError(f"unknown --{flag.replace('_', '-')} {quoted(value)}; choose one of: {', '.join(valid)}")

def _positive(cfg: Config, *names: str):
    for n in names:
        if not getattr(cfg, n) > 0:
            raise UserError(f"--{n.replace('_', '-')} must be positive, got {quoted(getattr(cfg, n))}")
