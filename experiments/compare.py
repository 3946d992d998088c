"""CL, NCL, NCL+TopK and BayesNCL side by side: bayesncl_pyro/cli/compare.py (--help says how)."""

import sys

from bayesncl_pyro.cli.compare import main

if __name__ == "__main__":
    sys.exit(main())
