"""How long every novelty score takes for 10,000 images with S = 32 draws, against a one-minute budget.

    python experiments/bench_novelty.py                  # the compositional recipe's shapes, 10,000 images
    python experiments/bench_novelty.py --images 2000 --draws 8

The learner is the compositional recipe's (the small CNN, K = 64, gates at the published prior) with its weights as
initialised: the scores' cost depends on the shapes, not on what was learnt. The scorer is fitted on 4,000 training
images' features (the probes, kNN, Mahalanobis, TopK's class frequencies; without the control heads, whose training is
the evaluation's and is timed apart), then scores ``--images`` images from their backbone features, and the backbone's
own forward pass over those images is timed beside it. It prints seconds and the ratio of scoring to the budget (below
1: within it), measured in this one run.
"""

import argparse
import sys
import time

import torch

from bayesncl_pyro.config import Config
from bayesncl_pyro.evaluate.novelty_scores import NoveltyScorer
from bayesncl_pyro.infer.learner import ContrastiveLearner
from bayesncl_pyro.train.resolve import resolve

BUDGET_S = 60.0


def main(argv=None) -> int:
    """Entry point."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=10_000)
    p.add_argument("--draws", type=int, default=32)
    p.add_argument("--train", type=int, default=4000, help="training images the scorer is fitted on (default: 4000)")
    p.add_argument("--gate-head", default="mlp", choices=("mlp", "bayesian"))
    args = p.parse_args(argv)
    torch.manual_seed(0)
    cfg = resolve(Config(dataset="compositional", gate_head=args.gate_head, out="/nonexistent"))
    learner = ContrastiveLearner(cfg, in_channels=3, num_train=args.train).eval()
    x_train, x = torch.rand(args.train, 3, 32, 32), torch.rand(args.images, 3, 32, 32)
    with torch.no_grad():
        start = time.perf_counter()
        h = torch.cat([learner.backbone(chunk) for chunk in x.split(512)])
        backbone_s = time.perf_counter() - start
        h_train = torch.cat([learner.backbone(chunk) for chunk in x_train.split(512)])
    y_train = torch.arange(args.train) % 8
    start = time.perf_counter()
    scorer = NoveltyScorer(learner, h_train, y_train, 8, draws=args.draws)
    fit_s = time.perf_counter() - start
    start = time.perf_counter()
    scores = scorer(h)
    score_s = time.perf_counter() - start
    print(f"{len(scores)} scores of {args.images} images, S = {args.draws} draws, {torch.get_num_threads()} threads")
    print(f"fit on {args.train:,} training images: {fit_s:.1f} s; scoring: {score_s:.1f} s "
          f"(x{score_s / BUDGET_S:.2f} of the {BUDGET_S:.0f} s budget); the backbone's pass: {backbone_s:.1f} s "
          f"(scoring x{score_s / backbone_s:.2f} of it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
