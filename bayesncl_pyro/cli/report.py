"""A per-dimension report of a run, one self-contained HTML page to open in a browser (from file://, offline).

    python experiments/report.py runs/default                      # runs/default/report/index.html
    python experiments/report.py runs/default --baseline runs/ncl  # with the NCL run's dimensions beside

Writes RUN/report/ (or --out): index.html (images, script and style inline) and report.json (every number the page
shows). The page: an overview (configuration, evaluation gated / with every gate open / the baseline's, training curves,
the gate posterior, on the compositional benchmark which dimension tracks which factor), a card per dimension in use
(sortable and filterable: its top test images with the gates and with every gate open, images at activation quantiles,
the classes it fires on, q(g | x) per class, its activation histogram, its most correlated dimensions), and a page per
test image (its dimensions with q(g | x), its nearest neighbours with and without the gates).
bayesncl_pyro/evaluate/report.py builds it; README.md, "Looking at the gates", says what each part of a card means.
"""

import argparse
import sys
import time
from pathlib import Path

from bayesncl_pyro.cli import ArgumentParser, one_line_errors, stopped_by_signals
from bayesncl_pyro.plugins import add_reader_flags


@one_line_errors
def main(argv=None) -> int:
    """Entry point of experiments/report.py."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="a run folder written by run_svi.py")
    p.add_argument("--baseline", type=Path, help="another run on the same data (e.g. NCL): its dimensions in a list "
                   "of their own, its evaluation beside the run's")
    p.add_argument("--out", type=Path, help="where the report goes (default: RUN_DIR/report)")
    add_reader_flags(p)
    args = p.parse_args(argv)
    from bayesncl_pyro.evaluate.report import write_report  # after parsing: --help stays instant

    start = time.perf_counter()
    with stopped_by_signals("index.html and report.json are both written or both as they were"):
        page = write_report(args.run_dir, args.baseline, args.out, trust_code=args.trust_run, data_dir=args.data_dir)
    size = page.stat().st_size / 2**20
    print(f"wrote {page} ({size:.1f} MB) and {page.with_name('report.json')} in {time.perf_counter() - start:.0f} s; "
          f"open it in a browser: file://{page.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
