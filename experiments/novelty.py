"""Every novelty score of a run on images unlike its training data: bayesncl_pyro/cli/novelty.py (--help says how)."""

import sys

from bayesncl_pyro.cli.novelty import main

if __name__ == "__main__":
    sys.exit(main())
