"""Train CL, NCL or BayesNCL with SVI, then evaluate: bayesncl_pyro/cli/run_svi.py (--help says how)."""

import signal
import sys

from bayesncl_pyro.cli.run_svi import _stop_at_once, main

if __name__ == "__main__":
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, _stop_at_once)
    sys.exit(main())
