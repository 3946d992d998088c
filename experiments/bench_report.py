"""How long the per-dimension report takes at ImageNet-100's size: bayesncl_pyro/cli/bench_report.py (--help)."""

import sys

from bayesncl_pyro.cli.bench_report import main

if __name__ == "__main__":
    sys.exit(main())
