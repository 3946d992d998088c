"""The names of a run folder's files, the limits on reading them, and which folder holds a run."""

import logging
import os
from pathlib import Path

from bayesncl_pyro.errors import UserError

# one logger for the whole rule, named as the module was before its split: a user silences "bayesncl_pyro.rundir"
logger = logging.getLogger("bayesncl_pyro.rundir")

MARKER = "bayesncl-pyro.run"
CONFIG = "config.json"
CHECKPOINT = "checkpoint.pt"
LOG = "log.jsonl"
CONFLICT = "conflict.jsonl"
EVAL = "eval.json"
NOVELTY, NOVELTY_ROC = "novelty.json", "novelty-roc.png"  # experiments/novelty.py's
GATES_FILE = "gates.nc"
BAD_IMAGES = "bad_images.txt"
LOCK = "run.lock"
REPORT_DIR, INSPECT_DIR, WANDB_DIR = "report", "inspect", "wandb"
PREVIOUS = "previous-"  # prefix of the subfolders that --overwrite moves earlier runs into
_RUN_FILES = {MARKER, CONFIG, CHECKPOINT, LOG, CONFLICT, EVAL, GATES_FILE, BAD_IMAGES, LOCK, REPORT_DIR, INSPECT_DIR,
              WANDB_DIR, NOVELTY, NOVELTY_ROC}
_MARK = b"bayesncl-pyro run folder"
# names that no run writes, which make a marker beside them suspect: a repository, source files
_PROJECT = {".git", ".hg", ".svn", "pyproject.toml", "setup.py", "Makefile", "package.json"}
_SOURCE = {".py", ".ipynb", ".c", ".cc", ".cpp", ".h", ".rs", ".go", ".java", ".js", ".ts", ".sh"}


# The most a reader takes from a file of a run, in bytes: far above what a run writes (a million log records; the
# checkpoint of a ResNet-50 with its optimizer), far below what would exhaust a machine's memory
JSON_LIMIT = 64 * 2**20  # one JSON document: config.json, eval.json, a --config file
TEXT_LIMIT = 2**30  # log.jsonl, conflict.jsonl, bad_images.txt, a report's index.html and report.json
DATA_LIMIT = 2**36  # checkpoint.pt, gates.nc
# The most records read from a .jsonl file of a run: a run of a million steps that logs every one (a record costs a
# few hundred bytes to a kilobyte in memory)
MAX_RECORDS = 1_000_000
MAX_LINE = 2**24  # one record of a .jsonl file: a conflict record of K = 2048 dims is about 200 KB


def is_run_file(name: str) -> bool:
    """Whether ``name`` is the name of a file (or folder) that a run keeps in its folder."""
    return name in _RUN_FILES or name.startswith((PREVIOUS, "events.out.tfevents."))


def check_not_a_run_file(path: Path, flag: str):
    """Refuse ``path`` (what ``flag`` names) as a file to write where it would replace a file that a run keeps.

    That is a path named as a run's file (checkpoint.pt, log.jsonl, ...), or one inside a folder that a run keeps in
    its run folder (``report/``, ``inspect/``, ``previous-*``): every folder above the path that holds a run is looked
    at, not only the last name.
    """
    if is_run_file(path.name):
        raise UserError(f"{flag} {path}: {path.name} is the name of a file that a run keeps in its folder, and an "
                        "export never replaces one (of this run or another); name it otherwise, e.g. backbone.pt")
    real = Path(os.path.abspath(path))
    for below, folder in zip(real.parents, real.parents[1:]):
        if is_run_file(below.name) and (os.path.lexists(folder / MARKER) or os.path.lexists(folder / CHECKPOINT)):
            raise UserError(f"{flag} {path}: it lies in {below}, which the run in {folder} keeps, and an export never "
                            "writes into a run's files (of this run or another); name a path outside it, e.g. "
                            f"{folder / 'backbone.pt'}")


def run_folder(run: str | os.PathLike) -> Path:
    """The run folder that ``run`` names: the folder itself, or its ``checkpoint.pt``."""
    run = Path(run)
    return run.parent if run.name == CHECKPOINT and run.is_file() else run


def _below_run(folder: Path) -> tuple[Path, tuple[str, ...]] | None:
    """The run folder that holds ``folder`` (:func:`run_holding`) and the names that lead from it to ``folder``."""
    run = run_holding(folder)
    if run is None:
        return None
    named = Path(os.path.abspath(folder))
    path = named if run in (named, *named.parents) else named.resolve()
    return run, path.relative_to(run).parts


def run_holding(folder: Path) -> Path | None:
    """The run folder that is or holds ``folder``, or None.

    That is the outermost folder at or above it that holds our marker or a checkpoint, by the path as named or else
    by its target (a link named by the user that leads into a run). A folder inside a run folder is the run's,
    however it is named (``RUN/report``, ``--out RUN/inspect``, a link to one): its writers take the run's lock and
    reach it from the run folder without following a link.
    """
    named = Path(os.path.abspath(folder))
    for path in (named, named.resolve()):
        runs = [f for f in (path, *path.parents) if os.path.lexists(f / MARKER) or os.path.lexists(f / CHECKPOINT)]
        if runs:
            return runs[-1]
    return None
