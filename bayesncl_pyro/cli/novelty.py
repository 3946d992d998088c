"""What a run's scores say about images unlike its training data: every novelty score on each novel set.

    python experiments/novelty.py runs/x                         # the run's generated novel sets (compositional)
    python experiments/novelty.py runs/x --novel photos=my_photos/ --novel sketches=sketches/

prints a table (one row a score, one column a novel set: its AUROC against the run's test split, with FPR at 95 % TPR)
and writes RUN/novelty.json (per set its kind, size and each score's AUROC, FPR95, AUPR and the share flagged at the
test split's 95th percentile; ``evaluate.novelty_detection.report``) and RUN/novelty-roc.png (the ROC curves). What
each score is: docs/novelty.md. A run without gates gets the deterministic scores only; a folder of ``--novel`` images
counts as semantic novelty (to be flagged).
"""

import argparse
import math
import sys
from pathlib import Path

from bayesncl_pyro import rundir
from bayesncl_pyro.cli import ArgumentParser, one_line_errors, stopped_by_signals
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.plugins import add_reader_flags

CELL = 19


@one_line_errors
def main(argv=None) -> int:
    """Entry point of experiments/novelty.py."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="a run folder written by run_svi.py (or its checkpoint.pt)")
    p.add_argument("--novel", action="append", default=[], metavar="NAME=FOLDER",
                   help="a folder of images the run never saw, scored as the novel set NAME (repeatable)")
    p.add_argument("--no-controls", action="store_true", help="skip the control gating heads (a KL-0 head and an "
                   "ensemble of 5 trained on the frozen backbone: about a minute on a CPU)")
    add_reader_flags(p)
    args = p.parse_args(argv)
    folders = dict(_named(item) for item in args.novel)
    with stopped_by_signals("novelty.json and novelty-roc.png are each written whole or not at all"):
        report = novelty(args.run_dir, folders, controls=not args.no_controls, trust_code=args.trust_run,
                         data_dir=args.data_dir)
    print(table(report))
    return 0


def _named(item: str) -> tuple[str, Path]:
    name, sep, folder = item.partition("=")
    if not sep or not name or not folder:
        raise UserError(f"--novel takes NAME=FOLDER (a name for the set and a folder of its images), got {item!r}")
    if not Path(folder).is_dir():
        raise UserError(f"--novel {name}: {folder} is not a folder; give a folder of image files")
    return name, Path(folder)


def novelty(run_dir: Path, folders: dict[str, Path], controls: bool = True, **load) -> dict:
    """Score the run's novel sets and ``folders``; write RUN/novelty.json and RUN/novelty-roc.png; return the report.

    Everything is computed before anything is written, and the run folder's lock is held while writing.
    """
    from bayesncl_pyro.data.compositional import NOVEL_KINDS  # late: the imports of the evaluation take seconds
    from bayesncl_pyro.evaluate import novelty_detection
    from bayesncl_pyro.evaluate.heldout import extract
    from bayesncl_pyro.evaluate.novelty_figures import plot_roc
    from bayesncl_pyro.evaluate.run import load_run

    run = load_run(run_dir, **load)
    cfg, learner, data = run.cfg, run.learner, run.data
    sets = data.novel()
    if not sets and not folders:
        raise UserError(f"{run_dir} is a {cfg.dataset} run, which has no generated novel sets: name folders of novel "
                        "images with --novel NAME=FOLDER")
    scorer = run.novelty_scorer(controls)
    features = lambda images: extract(learner, images, cfg, data.channels, run.device)[0]  # noqa: E731
    in_scores = scorer(features(data.test))
    novel = {name: scorer(features(images)) for name, images in sets.items()}
    for name, folder in folders.items():
        if name in novel:
            raise UserError(f"--novel {name}: the run's data has a novel set of that name already; pick another name")
        novel[name] = run.novelty(folder, controls=controls)
    kinds = {**NOVEL_KINDS, **dict.fromkeys(folders, "semantic")}
    report = novelty_detection.report(in_scores, novel, kinds)
    folder = rundir.run_folder(run_dir)
    with rundir.held(folder):
        rundir.output_folder(folder)
        rundir.write_json(report, folder / rundir.NOVELTY)
        plot_roc(in_scores, novel, kinds, folder / rundir.NOVELTY_ROC)
    print(f"wrote {folder / rundir.NOVELTY} and {folder / rundir.NOVELTY_ROC}")
    return report


def table(report: dict) -> str:
    """The report as text: one row a score, one column a novel set; each cell AUROC (FPR95)."""
    sets = report["sets"]
    names = list(next(iter(sets.values()))["scores"])
    width = max(map(len, names))

    def cell(m: dict) -> str:
        return "n/a" if math.isnan(m["auroc"]) else f"{m['auroc']:.3f} ({m['fpr95']:.2f})"

    head = f"{'AUROC (FPR95)':<{width}}" + "".join(f"  {s[:CELL]:>{CELL}}" for s in sets)
    kind = f"{'':<{width}}" + "".join(f"  {v['kind'] + ', n=' + str(v['n']):>{CELL}}" for v in sets.values())
    rows = [f"{n:<{width}}" + "".join(f"  {cell(v['scores'][n]):>{CELL}}" for v in sets.values()) for n in names]
    note = ("a semantic set is to be flagged (AUROC near 1); a nuisance set changes no class, and a score that follows "
            "the class stays near 0.5 there")
    return "\n".join([head, kind, *rows, note])


if __name__ == "__main__":
    sys.exit(main())

