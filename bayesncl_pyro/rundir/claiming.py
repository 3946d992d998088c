"""Claiming a folder for a run, undoing the claim, and moving an earlier run aside (never deleting it)."""

import contextlib
import os
import re
import tempfile
import time
from pathlib import Path

from bayesncl_pyro._version import __version__
from bayesncl_pyro.config import Config
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.rundir.artefacts import load_checkpoint
from bayesncl_pyro.rundir.commit import atomic_save
from bayesncl_pyro.rundir.folders import _remember
from bayesncl_pyro.rundir.layout import _MARK, _PROJECT, _SOURCE, CHECKPOINT, CONFIG, LOCK, MARKER, PREVIOUS, logger
from bayesncl_pyro.rundir.locking import RunLock, _identity, lock
from bayesncl_pyro.rundir.opening import exists, read_bytes, read_json
from bayesncl_pyro.rundir.temporaries import _remove_temporaries


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
    if not exists(saved):
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
