"""The folders written into: checked once, then reached by a descriptor, from the run folder a name at a time."""

import contextlib
import errno
import os
import stat
from pathlib import Path

from bayesncl_pyro.errors import UserError
from bayesncl_pyro.rundir.beneath import open_beneath
from bayesncl_pyro.rundir.layout import _below_run
from bayesncl_pyro.rundir.locking import held, holding

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


def _first_not_a_folder(run: Path, names: tuple[str, ...]) -> Path:
    """The first of ``run / names[:1]``, ``run / names[:2]``, ... that is a link or no folder (the last if none is)."""
    for i in range(1, len(names)):
        inner = run.joinpath(*names[:i])
        if not stat.S_ISDIR(os.lstat(inner).st_mode):
            return inner
    return run.joinpath(*names)


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
    mine = holding(named)
    if mine is not None:  # a run folder this process locked: from the folder it locked, even if since replaced
        place = mine.named, named.relative_to(mine.named).parts
        fd = os.dup(mine.dir)
    else:
        place = _below_run(folder)
        fd = os.open(place[0] if place else folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if place and place[1]:
            try:
                inner = open_beneath(fd, place[1], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise _linked_inside(_first_not_a_folder(*place), place[0]) from None
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
