"""Look at what a run learned: ELBO curves, the gate posterior, class-specific dimensions, the conflict.

    python experiments/inspect_gates.py runs/default                          # a BayesNCL run
    python experiments/inspect_gates.py runs/default --baseline runs/ncl      # conflict next to NCL
    python experiments/inspect_gates.py runs/default --export                 # rewrite gates.nc first

Writes into RUN_DIR/inspect/ (or --out) PNG figures and summary.txt (also printed):

    elbo.png            -ELBO per row and its two terms (InfoNCE, KL) over training
    kl_per_dim.png      KL(q(g_k | x) || p(g_k)) per dimension, averaged over the test images
    inclusion.png       distribution of the inclusion probabilities q(g_k = 1 | x)
    class_heatmap.png   class x dimension mean inclusion, dimensions grouped by the class they prefer
    top_images.png      test images that most activate the most class-consistent dimensions
    conflict.png        the InfoNCE gradient conflict per dimension against its activation frequency

An NCL or CL run gets the figures that need no gates (elbo, top_images, conflict).
"""

import argparse
import sys
from pathlib import Path

from bayesncl_pyro.cli import ArgumentParser, one_line_errors, stopped_by_signals
from bayesncl_pyro.evaluate.figures import inspect
from bayesncl_pyro.plugins import add_reader_flags


@one_line_errors
def main(argv=None) -> int:
    """Entry point of experiments/inspect_gates.py."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="a run folder written by run_svi.py")
    p.add_argument("--baseline", type=Path, help="another run folder (e.g. NCL) drawn next to it in conflict.png")
    p.add_argument("--out", type=Path, help="where the figures go (default: RUN_DIR/inspect)")
    p.add_argument("--export", action="store_true", help="first (re)write RUN_DIR/gates.nc, the gate posterior as "
                   "ArviZ data, from the checkpoint (after a run whose export failed)")
    add_reader_flags(p)
    args = p.parse_args(argv)
    with stopped_by_signals("every file written so far is whole, and no temporary file is left"):
        summary = inspect(args.run_dir, args.out, args.baseline, args.export, trust_code=args.trust_run,
                          data_dir=args.data_dir)
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
