"""How biased is each gate estimator's gradient? On one training batch of a trained BayesNCL run.

    python experiments/gate_gradient_bias.py runs/default                  # the default run: compositional, ste
    python experiments/gate_gradient_bias.py runs/default --draws 256 --reference-draws 256 --json bias.json

For each estimator (ste, relaxed, st-sampled, leg, gs, gs-reference-kl, and score: the score-function gradient of the
program as written, as Pyro's TraceGraph_ELBO takes it; the run's gating head as trained, or with --untrained at
initialisation, only the estimator swapped) it compares the head's gradient of -ELBO per row with an unbiased gradient
of the same objective (exact in each gate, Monte Carlo over the others: bayesncl_pyro/infer/gate_gradients.py). It
prints, for the estimator's mean gradient over --draws draws (its bias), the cosine with the unbiased one, the relative
error and the norm ratio; the mean cosine of a single draw (one training step); and the cosines between the two halves
of the estimator's draws and of the unbiased estimate's draws (how precise each mean is: read the first columns only
when these are near 1). The batch holds the images of the run's first training batch, two SimCLR views each (drawn image
by image, as --augment workers draws them), through the encoder in eval mode.
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from bayesncl_pyro import rundir
from bayesncl_pyro.cli import ArgumentParser, one_line_errors
from bayesncl_pyro.data import load_dataset
from bayesncl_pyro.data.pipeline import EpochSampler
from bayesncl_pyro.data.views import TwoViews, collate_views, simclr_transform
from bayesncl_pyro.evaluate.loading import load_learner
from bayesncl_pyro.infer.estimators import GATES, gate_class
from bayesncl_pyro.infer.gate_gradients import SCORE, gate_gradient_bias
from bayesncl_pyro.infer.learner import ContrastiveLearner
from bayesncl_pyro.plugins import add_reader_flags


def first_batch(cfg, data, batch_size: int) -> torch.Tensor:
    """2B rows [view 1; view 2] of the run's first training batch of B images (the trainer's sampler and collate)."""
    views = TwoViews(data.train, simclr_transform(cfg.image_size, data.channels), cfg.seed)
    order = itertools.islice(EpochSampler(len(data.train), batch_size, cfg.seed), batch_size)
    return collate_views([views[i] for i in order])


@one_line_errors
def main(argv=None) -> int:
    """Entry point of experiments/gate_gradient_bias.py."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="a BayesNCL run folder written by run_svi.py")
    p.add_argument("--estimators", default=",".join((*GATES, SCORE)), help="comma-separated; score is the "
                   "score-function (REINFORCE) gradient of the program as written (default: %(default)s)")
    p.add_argument("--draws", type=int, default=64, help="gradient draws per sampled estimator (default: %(default)s)")
    p.add_argument("--reference-draws", type=int, default=64,
                   help="gate draws of the unbiased gradient (default: %(default)s)")
    p.add_argument("--batch-size", type=int, help="images in the batch (default: the run's)")
    p.add_argument("--seed", type=int, default=0, help="of the gate draws (default: %(default)s)")
    p.add_argument("--untrained", action="store_true", help="measure the run's configuration at initialisation "
                   "(weights drawn with --seed), not its trained weights: what training did to the gradients")
    p.add_argument("--json", type=Path, help="also write the results here")
    add_reader_flags(p)
    args = p.parse_args(argv)
    learner, cfg = load_learner(args.run_dir, trust_code=args.trust_run, data_dir=args.data_dir)
    if args.untrained:
        torch.manual_seed(args.seed)
        learner = ContrastiveLearner(cfg, learner.in_channels, learner.head.num_rows // 2)
    names = args.estimators.split(",")
    for name in names:
        if name != SCORE:
            gate_class(name)  # before the data loads
    data = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed, holdout=cfg.holdout_cells)
    x = first_batch(cfg, data, min(args.batch_size or cfg.batch_size, len(data.train)))
    torch.manual_seed(args.seed)
    results = gate_gradient_bias(learner, x, names, args.draws, args.reference_draws)
    state = "untrained (initial weights)" if args.untrained else f"trained with {cfg.gate}"
    print(f"run {args.run_dir} ({state}), {x.shape[0]} rows, K = {cfg.proj_dim}, "
          f"lambda = {cfg.kl_weight}, kl clamp {cfg.kl_clamp}")
    columns = [("cosine", "cosine"), ("rel. error", "relative_error"), ("norm ratio", "norm_ratio"),
               ("1-draw cos", "single_draw_cosine"), ("split cos", "split_cosine"),
               ("ref. split cos", "reference_split_cosine")]
    print(f"{'estimator':<16}" + "".join(f" {title:>14}" for title, _ in columns))
    for r in results:
        print(f"{r['estimator']:<16}" + "".join(f" {r[key]:>14.4f}" for _, key in columns))
    if args.json:
        # by the rule of rundir, as every writer: written whole by a rename, never through a link
        rundir.output_folder(args.json.parent, named=True)
        rundir.atomic_save((json.dumps(results, indent=1) + "\n").encode(), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
