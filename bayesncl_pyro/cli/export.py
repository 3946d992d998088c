"""Export a trained run's weights for use without this project: the backbone's plain state_dict, the head's beside it.

    python experiments/export.py runs/x --out backbone.pt      # also writes backbone_head.pt

The backbone file is ``backbone.state_dict()`` exactly: a torchvision model loads it into
``torchvision.models.get_model(name)`` once the run's changes are made to it (its classifier replaced by
``Identity``, as the run did; below 64 px a ResNet's CIFAR stem), and the script prints those lines. Any other
backbone loads into ``bayesncl_pyro.nn.encoders.build_backbone(encoder, channels, image_size)``. The head file is the
``BayesNCLHead``'s state_dict (projector, gating head, prior): the printed ``BayesNCLHead(...)`` with the run's
arguments loads it.
"""

import argparse
import sys
from pathlib import Path

from bayesncl_pyro import rundir
from bayesncl_pyro.cli import ArgumentParser, one_line_errors, stopped_by_signals
from bayesncl_pyro.evaluate.weights import export_weights
from bayesncl_pyro.plugins import add_reader_flags


@one_line_errors
def main(argv=None) -> int:
    """Entry point of experiments/export.py."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="a run folder written by run_svi.py (or its checkpoint.pt)")
    p.add_argument("--out", type=Path, help="the backbone's state_dict (default: RUN_DIR/backbone.pt)")
    p.add_argument("--head-out", type=Path, help="the head's state_dict (default: beside --out, <name>_head.pt)")
    add_reader_flags(p, data_dir=False)
    args = p.parse_args(argv)
    out = args.out or rundir.run_folder(args.run_dir) / "backbone.pt"
    with stopped_by_signals("the two files are both written or both as they were, and no temporary file is left"):
        lines = export_weights(args.run_dir, out, args.head_out, args.trust_run)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
