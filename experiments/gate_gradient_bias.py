"""How biased is each gate estimator's gradient: bayesncl_pyro/cli/gate_gradient_bias.py (--help says how)."""

import sys

from bayesncl_pyro.cli.gate_gradient_bias import main

if __name__ == "__main__":
    sys.exit(main())
