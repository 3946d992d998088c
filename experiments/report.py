"""A per-dimension report of a run, one HTML page: bayesncl_pyro/cli/report.py (--help says how)."""

import sys

from bayesncl_pyro.cli.report import main

if __name__ == "__main__":
    sys.exit(main())
