"""Writing a set of files all or none: temporaries fsynced, then renamed by the folder's descriptor, signals held."""

import contextlib
import errno
import json
import os
import signal
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from bayesncl_pyro.errors import Stopped, UserError
from bayesncl_pyro.rundir.beneath import _kind
from bayesncl_pyro.rundir.folders import _open_folder
from bayesncl_pyro.rundir.locking import held
from bayesncl_pyro.rundir.temporaries import sweep, temporary_name

Content = bytes | Callable[[BinaryIO], object] | object  # bytes, a function that writes a file, or torch.save's


def atomic_save(obj: Content, path: Path):
    """Write ``obj`` to ``path`` by :func:`save_together`."""
    save_together([(obj, path)])


def json_bytes(obj) -> bytes:
    """``obj`` as a run's JSON files hold it: indented, ending with a newline."""
    return json.dumps(obj, indent=2).encode() + b"\n"


def write_json(obj, path: Path):
    """Write ``obj`` as indented JSON to ``path``, atomically (:func:`atomic_save`)."""
    atomic_save(json_bytes(obj), path)


def save_figure(fig, path: Path, **savefig):
    """Write the matplotlib figure ``fig`` as a PNG to ``path``, atomically (:func:`atomic_save`)."""
    atomic_save(lambda f: fig.savefig(f, format="png", **savefig), path)


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
            tmp = temporary_name(path.name)
            sweep(folder, path.name, path.parent in locked)
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


def cannot_write(path: Path, e: OSError) -> str:
    """The message for a failed write of ``path``, with the fix that its errno calls for."""
    fix = "choose another --out, in a folder you can write" if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM) \
        else "free some space or choose another --out" if e.errno in (errno.ENOSPC, errno.EDQUOT) \
        else "move it away or choose another --out"  # a folder in the file's place (EISDIR), ...
    return f"cannot write {path}: {e.strerror or e}; {fix}"
