"""Export a trained run's weights for use without this project: bayesncl_pyro/cli/export.py (--help says how)."""

import sys

from bayesncl_pyro.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
