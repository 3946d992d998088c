"""A run folder: claiming it, moving an earlier run aside, and every read and write of a file in it.

    bayesncl-pyro.run  our marker, written when a run claims the folder: only a folder that holds it (or, from a
                    version before it, a checkpoint of ours) is taken for a run, resumed or moved aside
    config.json     the resolved Config (what was actually run)
    checkpoint.pt   state_dicts, optimizer, scheduler, RNG states, step; replaced atomically
    log.jsonl       one JSON object every ``log_every`` steps (with ``warnings`` when the gates degenerate); a
                    resume cuts it, and conflict.jsonl, back to its checkpoint's step (:func:`cut_records`)
    conflict.jsonl  the per-dimension InfoNCE gradient conflict every ``conflict_every`` steps (diagnostics.py)
    eval.json       the evaluation of the final model
    gates.nc        BayesNCL only: the gate posterior on the test split, as ArviZ data (arviz_export.py)
    bad_images.txt  with --skip-bad-images: the unreadable files that were skipped, one per line
    run.lock        locked (flock) by the process training in the folder, whose pid it holds
    report/, inspect/, wandb/   what report.py, inspect_gates.py and --wandb write

Nothing here deletes a user's file: an earlier run is moved into a ``previous-<time>`` subfolder, a folder that
holds anything else is refused, and every file is replaced by a rename, so a crash mid-write leaves the previous
version intact (its temporary file, named by the writing process, is removed by the next run in the folder).

A run folder is data, perhaps from elsewhere, and every reader and writer of one (the trainer, report, inspect_gates,
export, compare --record, load_run) goes through the one rule here: a file in it is opened without following a
symbolic link and only if it is a regular file (:func:`open_file`; a link, a FIFO or a device is refused in one line
naming it, and a file written in place, the lock or a log, that has other hard links), a read takes at most a limit in
bytes (the records of a log, at most ``MAX_RECORDS``), and a write goes to a temporary file and is renamed into a
real folder (:func:`save_together`, :func:`output_folder`; a folder inside the run that is a link is refused, and one
replaced since it was checked, by its device and inode), under the run's lock (:func:`held`). Only the folders the
user names (the run folder, ``--out``) may be links. Reading a run imports no code that its
configuration names unless asked to (``trust_code``, :func:`check_code`), and reads its data folder only from an
absolute path outside the run folder (``evaluate.loading.load_learner``).
"""

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import signal
import socket
import stat
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from bayesncl_pyro._version import __version__
from bayesncl_pyro.config import Config, check_extent, parse_file
from bayesncl_pyro.errors import Stopped, UserError
from bayesncl_pyro.plugins import TIMM, is_spec

logger = logging.getLogger(__name__)

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
# the files a run replaces (save_together): a run killed while writing one leaves its <name>.<pid>.tmp
_TEMPORARY = re.compile("(" + "|".join(map(re.escape, (CHECKPOINT, CONFIG, EVAL, GATES_FILE, MARKER))) + r")\.\d+\.tmp")

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


# -- the rule: opening a file of a run -------------------------------------------------------------------------


def _open(path: Path, flags: int, follow: bool = False) -> int:
    """Return ``os.open(path, flags)`` of a regular file, never through a symbolic link, without waiting on a FIFO.

    ``follow``: a file the user named may be a link. Anything but a regular file is a UserError naming it, and so is
    a file of a run opened for writing that has other hard links (O_NOFOLLOW does not see them: the write would land
    in the file elsewhere); other OSErrors pass.
    """
    try:
        fd = os.open(path, flags | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW), 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow and path.is_symlink():
            raise UserError(f"{path} is a symbolic link, to {os.readlink(path)}; a file of a run folder is never "
                            "read or written through one (it may point anywhere): replace the link by the file, or "
                            "move it away") from None
        if e.errno == errno.ENXIO:  # a FIFO that no process reads, opened for writing
            raise UserError(_not_a_file(path, "a named pipe (FIFO)", follow)) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UserError(_not_a_file(path, _kind(mode), follow))
    links = os.fstat(fd).st_nlink
    if links > 1 and not follow and flags & (os.O_WRONLY | os.O_RDWR):
        os.close(fd)
        raise UserError(f"{path} has {links} hard links, so it is also a file elsewhere; a run never writes into a "
                        "file it shares (the other name would change too): replace it by a copy of its own (cp FILE "
                        "FILE.new && mv FILE.new FILE), or move it away")
    os.set_blocking(fd, True)
    return fd


def _kind(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) that is no regular file is, in words."""
    return "a folder" if stat.S_ISDIR(mode) else "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else \
        "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket"


def _not_a_file(path: Path, kind: str, follow: bool) -> str:
    """The message refusing ``path``, which is ``kind`` (a folder, a FIFO, ...), not a regular file."""
    return f"{path} is {kind}, not a regular file; " + (
        "pass a regular file" if follow else "a run's files are regular files: move it away")


def open_file(path: Path, limit: int, *, follow: bool = False) -> BinaryIO:
    """Open ``path`` for reading, by the rule of this module.

    It must be a regular file of at most ``limit`` bytes, not reached through a symbolic link (``follow``: a file the
    user named, such as ``--config``, may be one).
    """
    try:
        fd = _open(Path(path), os.O_RDONLY, follow)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    size = os.fstat(fd).st_size
    if size > limit:
        os.close(fd)
        raise UserError(f"{path} holds {size:,} bytes, more than the {limit:,} that a file of its kind is read up to; "
                        + ("pass a smaller file" if follow else "it is not what a run writes: move it away"))
    return os.fdopen(fd, "rb")


def read_bytes(path: Path, limit: int, *, follow: bool = False) -> bytes:
    """The content of ``path`` (:func:`open_file`), at most ``limit`` bytes (a file that grows while read, too)."""
    with open_file(path, limit, follow=follow) as f:
        # what fstat found, then in chunks up to the limit: f.read(limit + 1) reserved the whole limit (1 GiB for a
        # log of a few lines), which failed under an address-space cap
        chunks = [f.read(os.fstat(f.fileno()).st_size)]
        read = len(chunks[0])
        while read <= limit and (chunk := f.read(min(2**16, limit + 1 - read))):
            chunks.append(chunk)
            read += len(chunk)
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    if len(data) > limit:
        raise UserError(f"{path} grew past {limit:,} bytes while it was read; it is not what a run writes: move it "
                        "away")
    return data


def read_json(path: Path, limit: int = JSON_LIMIT, *, fix: str = "it is not what a run writes: move it away"):
    """Return the JSON document in ``path`` (:func:`read_bytes`).

    One that does not parse (or nests too deep for Python) is a UserError ending with ``fix``.
    """
    data = read_bytes(path, limit)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        cause = "nested too deep" if isinstance(e, RecursionError) else str(e).splitlines()[0]
        raise UserError(f"{path} is not readable JSON ({cause}); {fix}") from None


def read_records(path: Path) -> list[dict]:
    """Return the records of a run's ``.jsonl`` file, one JSON object with a ``step`` per line (empty if no file).

    Read a line at a time, at most ``MAX_RECORDS`` records: the file whole, split into lines, cost about 27 times its
    size in memory, a log of tiny records under the size limit some 27 GiB. A line that is no record, as the last one
    of a run killed while writing it, is left out, with a note.
    """
    if not os.path.lexists(path):
        return []
    records, bad, first_bad, read, number = [], 0, None, 0, 0
    with open_file(path, TEXT_LIMIT) as f:
        # a line at a time, each at most MAX_LINE bytes, the bytes counted as they come: the size checked at open
        # says nothing of a file that grows while it is read, or of one line of a gigabyte (a sparse file)
        while line := f.readline(MAX_LINE + 1):
            number, read = number + 1, read + len(line)
            if len(line) > MAX_LINE or read > TEXT_LIMIT:
                what = f"a line of more than {MAX_LINE:,} bytes" if len(line) > MAX_LINE else \
                    f"more than {TEXT_LIMIT:,} bytes (it grew while read)"
                raise UserError(f"{path} holds {what}, which no run writes: it is not what a run writes: move it "
                                "away")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                record = None
            if not (isinstance(record, dict) and type(record.get("step")) is int):
                bad, first_bad = bad + 1, first_bad or number  # a count: a file of bad lines costs no memory
            elif len(records) < MAX_RECORDS:
                records.append(record)
            else:
                raise UserError(f"{path} holds more than {MAX_RECORDS:,} records, more than a run writes (one every "
                                "--log-every steps); it is not what a run writes: move it away")
    if bad:
        logger.warning(f"note: {path}: {bad} line(s) are not records of a run (the first: line {first_bad}; a run "
                       "killed while writing one leaves it cut short); they are left out")
    return records


def read_config_file(path: str | os.PathLike) -> dict:
    """Return the Config fields that a JSON or YAML file sets (``run_svi.py --config``; ``config.parse_file``).

    The file is read by the rule of this module; the user names it, so it may be a link.
    """
    return parse_file(Path(path), read_bytes(Path(path), JSON_LIMIT, follow=True))


# -- claiming the folder ---------------------------------------------------------------------------------------


def claim(out: Path, cfg: Config, overwrite: bool) -> "RunLock":
    """Claim the run folder ``out`` for ``cfg`` and return its lock, to be held for the life of the run.

    The folder is created, or checked to hold this very run; with ``overwrite`` the run it holds is moved aside
    first. A run that cannot take the lock is refused.

    Refused: ``out`` being the working folder or the data folder, holding either, or lying in the data folder; a
    folder held by another running process; and one that holds files but no run of ours (:func:`holds_a_run`:
    our marker, whatever its config.json says), with ``overwrite`` too. A run there that differs from ``cfg`` but
    never wrote a checkpoint (it was refused or diverged at its first steps) is moved aside: it holds nothing to
    resume. Writes the marker, no file of the run: the trainer writes ``config.json`` once the run is set up, so
    that a run refused before it trains (a batch larger than the data set) leaves nothing that would refuse the
    corrected command; the trainer then undoes the claim itself (:func:`unclaim`).
    """
    _check_place(out, cfg.data_dir)
    created = not os.path.lexists(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the output folder {out}: {e.strerror}; choose another --out")
    _remember(out, named=True)
    # every name counts, ours too: without our marker (or checkpoint) a previous-* folder or a checkpoint.pt.<n>.tmp
    # is the user's, which the cleaning below would delete; but for a lock file as a run leaves it (a run that holds
    # it has not written its marker yet: it is refused below as in use)
    theirs = [p.name for p in sorted(out.iterdir()) if not (p.name == LOCK and _a_lock_of_ours(p))]
    if theirs and not holds_a_run(out):  # checked before the lock file is made: a user's folder stays as it is
        shown = ", ".join(theirs[:4]) + (f" and {len(theirs) - 4} more" if len(theirs) > 4 else "")
        raise UserError(f"{out} holds files that are not a bayesncl-pyro run ({shown}); pass a new or empty --out "
                        "(--overwrite moves only an earlier run's files aside)")
    suspect = [name for name in theirs if name in _PROJECT or Path(name).suffix in _SOURCE]
    if suspect:  # a marker copied or forged into a project: --overwrite would move the repository aside
        raise UserError(f"{out} holds our marker {MARKER}, but also {', '.join(suspect[:4])}, which no run writes (a "
                        "repository, source files): a marker there is not a run's; pass a new or empty --out, or move "
                        "them away")
    held = lock(out)
    held.created = created
    if not os.path.lexists(out / MARKER):
        atomic_save(f"{_MARK.decode()}, written by bayesncl-pyro {__version__}: rerunning its command resumes the "
                    "run, --overwrite moves its files aside\n".encode(), out / MARKER)
    _remove_temporaries(out)
    if overwrite:
        move_aside(out)
    else:
        what = differences(out, cfg)
        if what and not os.path.lexists(out / CHECKPOINT):
            logger.warning(f"note: {out} holds a run with a different configuration ({what}) that wrote no checkpoint")
            move_aside(out)
        elif what:
            raise UserError(f"{out} holds a run with a different configuration ({what}); "
                            "rerun with the same flags to resume it, pass --overwrite to move it aside "
                            "and start afresh, or pass another --out")
    return held


def _a_lock_of_ours(path: Path) -> bool:
    """Whether ``path`` is a lock file as :class:`RunLock` leaves it: empty, or naming its process."""
    try:
        return re.fullmatch(rb"(process \d+ on .+\n)?", read_bytes(path, 4096)) is not None
    except UserError:  # a link, a FIFO, a folder: not ours
        return False


def holds_a_run(folder: Path) -> bool:
    """Whether ``folder`` holds a run of ours.

    That is our marker, which every run writes when it claims its folder, or, from a version before the marker, a
    checkpoint of ours (read to tell: one that is not ours is a UserError saying so). Never a ``config.json``, which
    any project may hold.
    """
    if os.path.lexists(folder / MARKER):
        return read_bytes(folder / MARKER, 4096).startswith(_MARK)
    if os.path.lexists(folder / CHECKPOINT):
        load_checkpoint(folder / CHECKPOINT)
        return True
    return False


def differences(folder: Path, cfg: Config) -> str | None:
    """Return how the run in ``folder`` differs from ``cfg`` (``Config.differences``: "" for this very run).

    None if the folder holds no configuration; one that cannot be read is a UserError, never taken for another run.
    """
    saved = folder / CONFIG
    if not os.path.lexists(saved):
        return None
    fix = "pass --overwrite to move the folder's files aside and start afresh, or pass another --out"
    try:
        old = Config.from_dict(read_json(saved, fix=fix))
    except (ValueError, TypeError):
        raise UserError(f"{saved} is not a readable run configuration; {fix}") from None
    return old.differences(cfg)


def _check_place(out: Path, data_dir: str | None):
    """Refuse an ``out`` that is, holds or lies in the working folder or the data folder.

    Refused: the working folder or the data folder, or a folder above one of them (moving its files aside,
    --overwrite, would move the user's repository or data set), or a folder in the data folder (its lock and files
    would sit in the data set, read as data), by their paths or by their folders' device and inode.
    """
    real = out.expanduser().resolve()
    ours = [_identity(p) for p in (real, *real.parents)]
    for what, place in (("the working folder", Path.cwd()), ("the data folder", data_dir)):
        if place is None:
            continue
        place = Path(place).expanduser().resolve()
        where = what if real == place else f"a folder above {what} ({place})" if real in place.parents else \
            f"inside {what} ({place})" if what == "the data folder" and place in real.parents else None
        # by device and inode too: a bind mount shows one folder under two paths, which resolve() cannot see
        theirs = [_identity(p) for p in (place, *place.parents)]
        if where is None and ours[0] is not None:
            where = f"{what}, by another path" if ours[0] == theirs[0] else \
                f"a folder above {what} ({place}), by another path" if ours[0] in theirs[1:] else None
        if where is None and what == "the data folder" and theirs[0] is not None and theirs[0] in ours[1:]:
            where = f"inside {what} ({place}), by another path"
        if where:
            raise UserError(f"--out {out} is {where}; a run needs a folder of its own: pass e.g. --out runs/NAME")


def _identity(path: Path) -> tuple[int, int] | None:
    """The device and inode of the folder at ``path``, None if there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _remove_temporaries(out: Path):
    """The temporary files that runs killed mid-write (SIGKILL) left: with the folder locked, no one writes them."""
    for tmp in out.iterdir():
        if _TEMPORARY.fullmatch(tmp.name):
            with contextlib.suppress(OSError):
                tmp.unlink()


class RunLock:
    """An exclusive ``flock`` on ``OUT/run.lock``, held while this object lives.

    The trainer's lives as long as the run, or until its process ends, whatever kills it. The file holds the holder's
    pid, for the next run's message.
    """

    def __init__(self, out: Path):
        path = out / LOCK
        try:  # a lock file is never replaced, so a lock always guards the same file
            self.file = os.fdopen(_open(path, os.O_RDWR | os.O_CREAT), "r+")
        except OSError as e:  # another user's lock, a read-only folder: without the lock the run is refused
            raise UserError(f"cannot lock {out}: {path} cannot be opened for writing ({e.strerror}), and without "
                            "its lock a second run could train in the folder at the same time; choose another "
                            "--out, in a folder you can write") from None
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = self.file.read(200).strip() or "another process"
            self.file.close()
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UserError(f"cannot lock {path}: {e.strerror}; choose another --out") from None
            raise UserError(f"{out} is in use by another run ({holder}); wait for it to end, or pass another "
                            "--out") from None
        self.file.truncate()
        self.file.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        self.file.flush()
        self.created = False  # whether the claim that took it created the folder (claim sets it)
        # the run folder, opened once: every write into it starts from this descriptor, so that the folder swapped
        # for a link later (in a shared parent) sends nothing elsewhere
        self.named = Path(os.path.abspath(out))
        self.dir = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.identity = _identity(out)
        weakref.finalize(self, os.close, self.dir)

    def close(self):
        """Let the lock go (it goes with the last copy of its file: a forked worker's too)."""
        self.file.close()


def unclaim(out: Path, held: RunLock):
    """Undo the claim of a run refused before it wrote a file (no data, a batch larger than the training set).

    The marker and the lock go, and the folder too where the claim created it, so that the corrected command meets no
    folder of a run that never was. A folder that holds anything else (an earlier run's files, a ``previous-`` folder
    that --overwrite made) keeps everything. ``held``: the lock :func:`claim` returned, released here.
    """
    if set(os.listdir(out)) <= {LOCK, MARKER}:
        with contextlib.suppress(FileNotFoundError):
            (out / MARKER).unlink()
        (out / LOCK).unlink()  # while still holding it: a run that opens it now finds no file to wait on
        held.close()
        if held.created:
            with contextlib.suppress(OSError):  # a folder someone wrote into meanwhile stays
                out.rmdir()
    else:
        held.close()


# the locks this process holds, by their run folder's device and inode (however the folder is named)
_HELD: "weakref.WeakValueDictionary[tuple[int, int], RunLock]" = weakref.WeakValueDictionary()


def _forget_locks():
    """Close a forked child's (a loader worker's) copy of the lock files.

    The parent's lock stays (it goes when every copy is closed), and no longer outlives the parent in a worker left
    behind by a SIGKILL.
    """
    for held in list(_HELD.values()):
        held.close()
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_locks)


def lock(out: Path) -> RunLock:
    """Take the lock of run folder ``out``, or return the one this process holds already.

    A second Trainer in one process resumes there, as a rerun would; a UserError where the lock can be neither.
    """
    held = _HELD.get(_identity(out))
    if held is None:
        held = RunLock(out)
        _HELD[held.identity] = held
    return held


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


@contextlib.contextmanager
def held(folder: Path):
    """Hold the lock of the run folder that is or holds ``folder`` (:func:`run_holding`) meanwhile.

    The one decision every writer into a run folder takes, :func:`save_together` at each write. The lock this
    process holds already (a trainer's, which exports its gates) stays held after; one taken here is let go. While
    another process trains there, a UserError: report.py, inspect_gates.py and export.py wrote beside it. With the
    lock held, :func:`save_together` also removes the temporary files that a killed writer left. A folder in no run
    (``export_gates`` into a folder of one's own, ``--out`` elsewhere) gets no lock file; None is yielded.
    """
    out = run_holding(folder)
    if out is None:
        yield None
        return
    mine = _identity(out) not in _HELD
    taken = lock(out)
    try:
        yield taken
    finally:
        if mine:
            _HELD.pop(taken.identity, None)
            taken.close()


def move_aside(out: Path):
    """Move the run folder's files into a new ``previous-<time>`` subfolder: restarting never deletes results.

    Its marker, its lock and earlier ``previous-*`` folders stay.
    """
    old = [p for p in out.iterdir() if not p.name.startswith(PREVIOUS) and p.name not in (LOCK, MARKER)]
    if not old:
        return
    try:
        aside = Path(tempfile.mkdtemp(prefix=f"{PREVIOUS}{time.strftime('%Y%m%d-%H%M%S')}-", dir=out))
        for p in old:
            p.rename(aside / p.name)
    except OSError as e:
        raise UserError(f"cannot move the previous run aside in {out}: {e.strerror}; "
                        "choose another --out") from None
    logger.info(f"moved the previous run's files in {out} to {aside}")


# -- writing ----------------------------------------------------------------------------------------------------


# The folders that output_folder (or claim) checked, by absolute path: the device and inode of the folder checked. A
# write opens its folder and writes by that descriptor, and only where it is still that folder: one swapped for a link
# between the check and the write (inspect_gates.py checks inspect/ seconds before its first figure) is refused
_CHECKED: dict[str, tuple[int, int]] = {}


def _remember(folder: Path, named: bool):
    """Record the folder checked at ``folder`` (``named``: a folder the user named, which may be a link)."""
    st = os.stat(folder) if named else os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):  # became a link (or a file) since it was checked
        raise UserError(f"{folder} was replaced while it was checked; nothing is written into a run folder through a "
                        "link: move it away and rerun")
    _CHECKED[os.path.abspath(folder)] = (st.st_dev, st.st_ino)


def _below_run(folder: Path) -> tuple[Path, tuple[str, ...]] | None:
    """The run folder that holds ``folder`` (:func:`run_holding`) and the names that lead from it to ``folder``."""
    run = run_holding(folder)
    if run is None:
        return None
    named = Path(os.path.abspath(folder))
    path = named if run in (named, *named.parents) else named.resolve()
    return run, path.relative_to(run).parts


def _linked_inside(folder: Path, run: Path) -> UserError:
    """The refusal of ``folder``, a folder inside the run folder ``run`` that is a symbolic link (or no folder)."""
    if not os.path.islink(folder):
        return UserError(f"{folder} is a file, not a folder; move it away, or pass another --out")
    return UserError(f"{folder} is a symbolic link, to {os.readlink(folder)}; a folder inside the run folder {run} is "
                     "the run's however it is named, and nothing is written through a link into a run folder (it may "
                     "point anywhere): move it away, or pass another --out")


def _open_folder(folder: Path) -> int:
    """A descriptor of ``folder`` to write into, refused where it is no longer the folder that was checked.

    Inside a run folder it is reached from the run folder, a name at a time, never through a link.
    """
    named = Path(os.path.abspath(folder))
    mine = next((held for held in list(_HELD.values()) if held.named in (named, *named.parents)), None)
    if mine is not None:  # a run folder this process locked: from the folder it locked, even if since replaced
        place = mine.named, named.relative_to(mine.named).parts
        fd = os.dup(mine.dir)
    else:
        place = _below_run(folder)
        fd = os.open(place[0] if place else folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, name in enumerate(place[1] if place else ()):
            try:
                inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise _linked_inside(place[0].joinpath(*place[1][:i + 1]), place[0]) from None
            os.close(fd)
            fd = inner
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    checked = _CHECKED.get(os.path.abspath(folder))
    if checked is not None and checked != (st.st_dev, st.st_ino):
        os.close(fd)
        now = f"a symbolic link, to {os.readlink(folder)}" if os.path.islink(folder) else "another folder"
        raise UserError(f"{folder} was replaced while it was written into (it is now {now}); nothing is written into "
                        "a folder that is not the one checked: move it away and rerun")
    return fd


def inner_folder(path: Path) -> Path:
    """Return ``path``, a folder inside a run folder or a record to read, refused where it is a symbolic link."""
    if path.is_symlink():
        raise UserError(f"{path} is a symbolic link, to {os.readlink(path)}; a folder inside a run folder or a record "
                        "is never read or written through one (it may point anywhere): move it away")
    return path


def output_folder(path: Path, named: bool = False) -> Path:
    """Return ``path``, a folder to write into, created if missing.

    It must be a real folder, not a symbolic link, which could point anywhere (``named``: a folder the user named,
    ``--out``, may be one, unless it lies in a run folder: a folder inside a run folder is the run's, however it is
    named). The folder is remembered: :func:`save_together` writes into it only while it is the same.
    """
    place = _below_run(path)
    if place is not None:  # checked before anything is created: mkdir would create through a link
        run, names = place
        for i in range(1, len(names) + 1):
            inner = run.joinpath(*names[:i])
            if not os.path.lexists(inner):
                break
            if not stat.S_ISDIR(os.lstat(inner).st_mode):
                raise _linked_inside(inner, run)
    elif not named and path.is_symlink():
        raise UserError(f"{path} is a symbolic link, to {os.readlink(path)}; nothing is written through one into a "
                        "run folder (it may point anywhere): move it away, or pass --out")
    try:
        with held(path) if place is not None else contextlib.nullcontext():  # created in a run only under its lock
            path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{path} is a file, not a folder; move it away, or pass another --out") from None
    except OSError as e:
        raise UserError(f"cannot create the folder {path}: {e.strerror}; pass another --out") from None
    _remember(path, named and place is None)
    return path


Content = bytes | Callable[[BinaryIO], object] | object  # bytes, a function that writes a file, or torch.save's


def atomic_save(obj: Content, path: Path):
    """Write ``obj`` to ``path`` by :func:`save_together`."""
    save_together([(obj, path)])


def write_json(obj, path: Path):
    """Write ``obj`` as indented JSON to ``path``, atomically (:func:`atomic_save`)."""
    atomic_save(json.dumps(obj, indent=2).encode() + b"\n", path)


def save_figure(fig, path: Path, **savefig):
    """Write the matplotlib figure ``fig`` as a PNG to ``path``, atomically (:func:`atomic_save`)."""
    atomic_save(lambda f: fig.savefig(f, format="png", **savefig), path)


_SWEPT: set[tuple[int, int, str]] = set()
"""(device, inode of a folder, file name) whose stale temporaries this process has removed (:func:`save_together`)."""


def save_together(items: list[tuple[Content, Path]]):
    """Write each ``obj`` to its ``path``, all or none: no crash or signal leaves a mix of old and new files.

    ``obj`` is bytes, a function that writes into a binary file, or else what ``torch.save`` takes. All go first to
    temporary files of this process beside them (created afresh, never through a link), each fsynced, then each is
    renamed over its path with SIGINT, SIGTERM and SIGUSR1 held back until all are. Each folder is opened once and
    written by its descriptor, and only if it is still the folder :func:`output_folder` checked; one in a run folder
    under the run's lock (:func:`held`), reached from the run folder without following a link. A crash, a full disk
    or a signal leaves the previous files or all the new ones, and no temporary file: any failure, an interrupt too,
    removes them. A failed write (disk full, read-only) raises ``UserError``.
    """
    folders, locked, temporaries, path = {}, set(), [], None
    locks = contextlib.ExitStack()
    try:
        for obj, path in items:
            if path.parent not in folders:
                if locks.enter_context(held(path.parent)) is not None:
                    locked.add(path.parent)
                folders[path.parent] = _open_folder(path.parent)
            folder = folders[path.parent]
            with contextlib.suppress(FileNotFoundError):
                mode = os.lstat(path.name, dir_fd=folder).st_mode
                if stat.S_ISDIR(mode):  # its rename would fail after those before it succeeded
                    raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
                if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):  # a rename would replace a device or a FIFO
                    raise UserError(f"cannot write {path}: it is {_kind(mode)}, not a regular file; pass a regular "
                                    "file or a new name")
            tmp = f"{path.name}.{os.getpid()}.tmp"  # two writers never share one
            # left by a killed process: one that had this pid, or under the run's lock (which no other writer holds)
            # any process's, looked for once a file and process (a listing at every write cost 2.2 s in a folder of
            # 400,000 files); a temporary of a process that died since is left for the next process
            swept = (os.fstat(folder).st_dev, os.fstat(folder).st_ino, path.name)
            if path.parent in locked and swept not in _SWEPT:
                stale = [name for name in os.listdir(folder)
                         if re.fullmatch(re.escape(path.name) + r"\.\d+\.tmp", name)]
                _SWEPT.add(swept)
            else:
                stale = [tmp]
            for name in stale:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=folder)
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=folder)
            temporaries.append((folder, tmp))
            with os.fdopen(fd, "w+b") as f:
                if isinstance(obj, bytes):
                    f.write(obj)
                elif callable(obj):
                    obj(f)
                else:
                    torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1})
        try:
            for (folder, tmp), (_, path) in zip(temporaries, items):
                os.replace(tmp, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    except BaseException as e:
        for folder, tmp in temporaries:
            with contextlib.suppress(OSError):  # on a read-only file system removing it fails too, and would hide e
                os.unlink(tmp, dir_fd=folder)
        # torch.save's zip writer fails on closing after a failed or interrupted write, with a RuntimeError
        # ("unexpected pos") that would hide the cause: a full disk, a Ctrl-C, a signal (cli.stopped_by_signals)
        cause = e.__context__ if isinstance(e, RuntimeError) and e.__context__ is not None else e
        if isinstance(cause, OSError):
            kept = f"any previous {path.name} is unchanged" if len(items) == 1 else \
                f"{', '.join(p.name for _, p in items)} are as they were"
            raise UserError(f"{cannot_write(path, cause)} ({kept})") from None
        if isinstance(cause, (KeyboardInterrupt, Stopped)):
            raise cause from None
        raise
    finally:
        for folder in folders.values():
            os.close(folder)
        locks.close()


def append_line(line: str | bytes, path: Path):
    """Append one line to ``path``, never through a link.

    The file is opened and closed each time: nothing is lost to a buffer on a crash. A line cut short by a crash is
    ended first, so that it stays one bad line (``read_records`` leaves it out).
    """
    data = line if isinstance(line, bytes) else line.encode()
    try:
        fd = _open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
        try:
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data
            os.write(fd, data + b"\n")  # one write: whole lines across processes (loader workers)
        finally:
            os.close(fd)
    except OSError as e:
        raise UserError(cannot_write(path, e)) from None


def cut_records(path: Path, step: int):
    """Cut a run's ``.jsonl`` file back to its records up to ``step``, the step of the checkpoint a run resumes from.

    A run killed after its checkpoint had logged the steps it then takes again: kept, they would stand twice, and what
    reads them (eval.json's ``conflict_*``) would differ from an uninterrupted run's. The file ends after the last
    record up to ``step`` before the first one past it; what follows, a line that a kill cut short too, goes. Called
    under the run's lock, before the run appends.
    """
    if not os.path.lexists(path):
        return
    try:
        fd = _open(path, os.O_RDWR)
        try:
            keep = end = 0
            with os.fdopen(os.dup(fd), "rb") as f:
                for line in f:
                    end += len(line)
                    if end > TEXT_LIMIT:
                        raise UserError(f"{path} holds more than {TEXT_LIMIT:,} bytes, more than a run writes; it "
                                        "is not what a run writes: move it away")
                    try:
                        record = json.loads(line)
                    except (ValueError, RecursionError):
                        continue  # a line that is no record: it goes with what follows, or stays with what precedes
                    if isinstance(record, dict) and type(record.get("step")) is int:
                        if record["step"] > step:
                            break
                        keep = end
            if keep < os.fstat(fd).st_size:
                os.ftruncate(fd, keep)
                os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise UserError(cannot_write(path, e)) from None


def cannot_write(path: Path, e: OSError) -> str:
    """The message for a failed write of ``path``, with the fix that its errno calls for."""
    fix = "choose another --out, in a folder you can write" if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM) \
        else "free some space or choose another --out" if e.errno in (errno.ENOSPC, errno.EDQUOT) \
        else "move it away or choose another --out"  # a folder in the file's place (EISDIR), ...
    return f"cannot write {path}: {e.strerror or e}; {fix}"


# -- reading what a run wrote ----------------------------------------------------------------------------------


def read_log(run_dir: str | os.PathLike) -> list[dict]:
    """The records of a run's ``log.jsonl`` (empty if there is none): :func:`read_records`."""
    return read_records(Path(run_dir) / LOG)


def read_eval(run_dir: str | os.PathLike, gate: str | None = None) -> dict:
    """Return a run's ``eval.json`` (``gate``: the run's gate estimator), in today's terms.

    An earlier version's file reads as today's: the share of gates open at the evaluation mask, which it named
    ``gate_rate`` (the log's name for the mean inclusion probability), as ``gates_open``, and one written before the
    reference protocol existed as ``protocol: fast``.
    """
    path = Path(run_dir) / EVAL
    results = read_json(path)
    if not isinstance(results, dict):
        raise UserError(f"{path} holds a {type(results).__name__}, not an evaluation; it is not what a run writes: "
                        "move it away")
    results.setdefault("protocol", "fast")
    if "gate_rate" in results:
        results["gates_open"] = results.pop("gate_rate")
        # 0.2.0 evaluated gs-reference-kl at q's mode; 0.3 at the reference's mask (0.1's gs, read as
        # gs-reference-kl, was evaluated there already)
        if gate == "gs-reference-kl":
            logger.warning(f"note: {path} evaluated the gs-reference-kl gates at q's mode, not at the reference's "
                           "mask 1[sigmoid(l) > 0.5] as this version does; move it away and rerun the same command to "
                           "evaluate the checkpoint again")
    return results


def load_checkpoint(path: Path) -> dict:
    """Load a checkpoint without executing code from it (weights-only unpickling), by the rule of this module."""
    with open_file(path, DATA_LIMIT) as f:
        try:
            with warnings.catch_warnings():  # torch's note on a pickle protocol it did not write: the error says enough
                warnings.simplefilter("ignore")
                state = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # any unpickling failure means the file is not a usable checkpoint
            raise UserError(f"cannot read checkpoint {path}: {_load_failure(e)}; it is corrupt or not a "
                            "bayesncl-pyro checkpoint (move it away to start afresh)") from None
    if not isinstance(state, dict) or not {"version", "config", "learner", "channels", "num_train"} <= state.keys() \
            or not isinstance(state["config"], dict):
        raise UserError(f"{path} is not a bayesncl-pyro checkpoint (it lacks the run's config and weights)")
    # a pickle keeps shared references: a kilobyte can hold a list of 2^40 items, which Config.to_dict would copy
    check_extent(state["config"], f"the config in {path}", "a list that holds another many times over",
                 "a run's config holds a few dozen: it is not what a run writes, move it away")
    return state


def _load_failure(e: Exception) -> str:
    """Say what a weights-only ``torch.load`` failed on, without torch's advice to pass ``weights_only=False``.

    That advice runs the code a pickle names: never for a file of unknown origin.
    """
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines or not lines[0].startswith("Weights only load failed"):
        return f"{e.__class__.__name__}: {lines[0] if lines else ''}"
    advice = ("Weights only load failed", "Please file an issue", "Check the documentation")
    detail = [line.removeprefix("WeightsUnpickler error:").strip() for line in lines
              if not line.startswith(advice) and "weights_only" not in line]
    detail = next((line for line in detail if line), "")
    return "it holds objects other than tensors and plain values" + (f" ({detail.rstrip('.')})" if detail else "")


def run_folder(run: str | os.PathLike) -> Path:
    """The run folder that ``run`` names: the folder itself, or its ``checkpoint.pt``."""
    run = Path(run)
    return run.parent if run.name == CHECKPOINT and run.is_file() else run


def code_references(cfg: Config) -> dict[str, str]:
    """Return the settings of ``cfg`` that name code to import (``package.module:name``): setting -> reference.

    An encoder ``timm:NAME`` is a model of the installed timm; a prior has no such form, and its ``timm:X`` imports a
    module. An encoder left None (the dataset's, before ``resolve``) names none.
    """
    prior = cfg.prior if cfg.method == "bayesncl" else None  # NCL and CL never build their config's prior
    return {flag: spec for flag, spec in (("encoder", cfg.encoder), ("prior", prior))
            if spec is not None and is_spec(spec) and not (flag == "encoder" and spec.startswith(TIMM))}


def check_config_code(path: str | os.PathLike, values: dict, trust: bool):
    """Refuse (or, trusted, announce) the code that a config file of a run folder names, as :func:`check_code`.

    ``values``: the fields the run takes from the file (``run_svi.py --config``). Whose file it is follows from where
    it lies (:func:`written_elsewhere`), never from what stands beside it only: a run's, a record's or another user's
    file names its writer's code. Another file is the user's own.
    """
    path = Path(path)
    if written_elsewhere(path):
        check_code(Config(**{k: values[k] for k in ("encoder", "prior") if k in values}), path, trust)


# the files that a run, or a record of one (compare.py --record keeps config.json, eval.json and log.jsonl), writes:
# a folder that holds one of them, or lies in one that does, is no place of the user's own configuration
_WRITTEN = (MARKER, CHECKPOINT, EVAL, LOG, CONFLICT, GATES_FILE)


def written_elsewhere(path: Path) -> bool:
    """Whether the file at ``path`` is its writer's, not the user's own.

    As git trusts a repository by where it lies and whose it is (``safe.directory``), not by what it holds: a file in a
    run folder or a record of one (a folder that holds a file a run writes, at any depth above the file, by the path
    named and by the link's target), or one owned by another user.
    """
    path = Path(os.path.abspath(path))
    for named in (path, path.resolve()):
        for folder in named.parents:
            if any(os.path.lexists(folder / name) for name in _WRITTEN):
                return True
    try:
        return os.stat(path).st_uid != os.geteuid()
    except OSError:
        return False


def check_code(cfg: Config, path: Path, trust: bool):
    """Refuse (or, trusted, announce) the modules that the encoder and prior of the run at ``path`` would import."""
    code = code_references(cfg)
    if not code:
        return
    named = ", ".join(f"{flag} {spec} (module {spec.partition(':')[0]})" for flag, spec in code.items())
    if not trust:
        raise UserError(f"{path} names code that opening it would import and run: {named}; open it with "
                        "--trust-run (trust_code=True in Python) only if you trust whoever wrote the run")
    logger.warning(f"note: trusting {path}: importing its {named}")
