"""The lock of a run folder: one flock a run folder and process, taken by every writer, let go in a forked child."""

import contextlib
import errno
import fcntl
import os
import socket
import weakref
from pathlib import Path

from bayesncl_pyro.errors import UserError
from bayesncl_pyro.rundir.beneath import open_regular
from bayesncl_pyro.rundir.layout import LOCK, run_holding
from bayesncl_pyro.rundir.opened import Opened, opened


def _identity(path: Path) -> tuple[int, int] | None:
    """The device and inode of the folder at ``path`` (the one this process reads there), None if there is none."""
    reader = opened(path)
    try:
        st = os.fstat(reader.dir) if reader is not None and reader.named == Path(os.path.abspath(path)) else \
            os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class RunLock:
    """An exclusive ``flock`` on ``OUT/run.lock``, held while this object lives.

    The trainer's lives as long as the run, or until its process ends, whatever kills it. The file holds the holder's
    pid, for the next run's message.
    """

    def __init__(self, out: Path):
        path = out / LOCK
        # the run folder, opened once: every read and write below it starts from this descriptor (its lock file too),
        # so that the folder swapped for a link later (in a shared parent) sends nothing elsewhere; where this process
        # reads it already (RunFolder.open), the folder it reads, so that it writes where it read
        folder, reader = None, opened(out)
        try:  # a lock file is never replaced, so a lock always guards the same file
            folder = os.dup(reader.dir) if reader is not None and reader.named == Path(os.path.abspath(out)) else \
                os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            self.file = os.fdopen(open_regular(folder, out, (LOCK,), os.O_RDWR | os.O_CREAT), "r+")
        except BaseException as e:  # another user's lock, a read-only folder: without the lock the run is refused
            if folder is not None:
                os.close(folder)
            if not isinstance(e, OSError):
                raise
            raise UserError(f"cannot lock {out}: {path} cannot be opened for writing ({e.strerror}), and without "
                            "its lock a second run could train in the folder at the same time; choose another "
                            "--out, in a folder you can write") from None
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = self.file.read(200).strip() or "another process"
            self.file.close()
            os.close(folder)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UserError(f"cannot lock {path}: {e.strerror}; choose another --out") from None
            raise UserError(f"{out} is in use by another run ({holder}); wait for it to end, or pass another "
                            "--out") from None
        self.file.truncate()
        self.file.write(f"process {os.getpid()} on {socket.gethostname()}\n")
        self.file.flush()
        self.created = False  # whether the claim that took it created the folder (claim sets it)
        self.named = Path(os.path.abspath(out))
        self.dir = folder
        st = os.fstat(folder)  # the folder locked, wherever its path leads now
        self.identity = st.st_dev, st.st_ino
        weakref.finalize(self, os.close, self.dir)

    def close(self):
        """Let the lock go (it goes with the last copy of its file: a forked worker's too)."""
        self.file.close()


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


def holding(folder: Path) -> RunLock | None:
    """The lock this process holds on a run folder that is or holds ``folder`` (by the name it was locked by)."""
    named = Path(os.path.abspath(folder))
    return next((held for held in list(_HELD.values()) if held.named in (named, *named.parents)), None)


def held_open(folder: Path) -> "RunLock | Opened | None":
    """The innermost folder this process holds open that is or holds ``folder``, locked or read.

    One it locked (:func:`holding`) or one it reads (``RunFolder.open``); the lock where both are the same folder
    (their descriptors are of one folder). Both have ``named`` (the name it was opened by) and ``dir`` (its
    descriptor): every read and write below ``folder`` starts from that descriptor.
    """
    found = [m for m in (holding(folder), opened(folder)) if m is not None]
    return max(found, key=lambda m: len(m.named.parts), default=None)  # max keeps the first of a tie: the lock


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
