"""Look at what a run learned: bayesncl_pyro/cli/inspect_gates.py (--help says how)."""

import sys

from bayesncl_pyro.cli.inspect_gates import main

if __name__ == "__main__":
    sys.exit(main())
