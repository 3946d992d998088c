"""Opening a file below a folder's descriptor: no name on the way a symbolic link, never leaving the folder.

Every file of a run folder is opened from a descriptor of the run folder (or of the folder the user named), with the
names that lead to it. Linux's ``openat2`` does that in one call (``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``, since
5.6); where the kernel or a seccomp filter lacks it, each name is opened from the one before with ``O_NOFOLLOW``, as
``os.open(name, flags, dir_fd=fd)``. Either way a link anywhere below the descriptor, not only in the file's own
place, is refused (ELOOP), and the file is checked to be a regular one (:func:`open_regular`).
"""

import ctypes
import errno
import functools
import os
import platform
import stat
import struct
from collections.abc import Sequence
from pathlib import Path

from bayesncl_pyro.errors import UserError

_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(platform.machine())  # the syscall's number, the same on both
_RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x04, 0x08
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def openat2(dir_fd: int, name: str, flags: int, mode: int = 0) -> int:
    """``openat2(dir_fd, name, {flags, mode, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS})``; an OSError on failure."""
    creates = flags & os.O_CREAT or flags & os.O_TMPFILE == os.O_TMPFILE  # O_TMPFILE holds O_DIRECTORY's bit
    how = struct.pack("QQQ", flags, mode if creates else 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)  # else EINVAL
    fd = _libc().syscall(ctypes.c_long(_OPENAT2), ctypes.c_int(dir_fd), ctypes.c_char_p(os.fsencode(name)),
                      ctypes.c_char_p(how), ctypes.c_size_t(len(how)))
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), name)
    return fd


@functools.cache
def _libc():
    """The C library, whose ``syscall`` calls openat2 (Python's ``os`` has no openat2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _has_openat2() -> bool:
    """Whether this kernel lets this process call openat2: without it ENOSYS, or EPERM from a container's filter."""
    if _OPENAT2 is None or not platform.system() == "Linux":
        return False
    try:
        os.close(openat2(-100, ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))  # -100: AT_FDCWD
    except OSError as e:
        return e.errno not in (errno.ENOSYS, errno.EPERM)
    return True


OPENAT2 = _has_openat2()
"""Whether :func:`open_beneath` takes the one call; otherwise a name at a time."""


def open_beneath(dir_fd: int, names: Sequence[str], flags: int, mode: int = 0o666) -> int:
    """``os.open`` of ``names`` (a relative path's parts) below the folder of ``dir_fd``, through no link.

    A link among them is an OSError ELOOP (or ENOTDIR, for a name that must be a folder), and so is a name that
    would leave the folder (``..``, an absolute path: EXDEV).
    """
    if not names or any(name in ("", ".", "..") or "/" in name for name in names):
        raise OSError(errno.EXDEV, "not a path below the folder", "/".join(names))
    if OPENAT2:
        return openat2(dir_fd, "/".join(names), flags | os.O_NOFOLLOW, mode)
    fd = dir_fd
    try:
        for name in names[:-1]:
            inner = os.open(name, _FOLDER, dir_fd=fd)
            if fd != dir_fd:
                os.close(fd)
            fd = inner
        return os.open(names[-1], flags | os.O_NOFOLLOW, mode, dir_fd=fd)
    finally:
        if fd != dir_fd:
            os.close(fd)


def first_link(folder: Path, names: Sequence[str]) -> Path | None:
    """The first of ``folder / names[:1]``, ``folder / names[:2]``, ... that is a symbolic link, None if none is."""
    return next((folder.joinpath(*names[:i]) for i in range(1, len(names) + 1)
                 if os.path.islink(folder.joinpath(*names[:i]))), None)


def open_below(dir_fd: int, folder: Path, names: Sequence[str], flags: int, kind: str = "file",
               shown: Path | None = None) -> int:
    """:func:`open_beneath` of ``folder / names``, a symbolic link on the way refused in one line that names it.

    ``dir_fd``: a descriptor of ``folder``; ``kind``: what ``names`` leads to, ``"file"`` or ``"folder"`` (the
    message's words); ``shown``: the path as the caller named it. Any other OSError passes.
    """
    try:
        return open_beneath(dir_fd, names, flags)
    except OSError as e:
        link = first_link(folder, names) if e.errno in (errno.ELOOP, errno.ENOTDIR) else None
        if link is None:
            raise
        last = link == folder.joinpath(*names)
        path = Path(shown) if shown is not None else folder.joinpath(*names)
        raise UserError(f"{path if last else link} is a symbolic link, to {os.readlink(link)}; a {kind} of a run "
                        "folder is never read or written through one (it may point anywhere): replace the link by "
                        f"the {kind if last else 'folder'}, or move it away") from None


def open_regular(dir_fd: int | None, folder: Path, names: Sequence[str], flags: int, follow: bool = False,
                 shown: Path | None = None) -> int:
    """Return a descriptor of the regular file ``folder / names``, opened below ``dir_fd`` without waiting on a FIFO.

    ``dir_fd``: a descriptor of ``folder`` (:func:`open_beneath`), or None for a file the user named (``follow``),
    opened by its path, which may be a link. Anything but a regular file is a UserError naming it (as ``shown``, the
    path as the caller named it), and so is a link on the way, and a file of a run opened for writing that has other
    hard links (O_NOFOLLOW does not see them: the write would land in the file elsewhere); other OSErrors pass.
    """
    path = Path(shown) if shown is not None else folder.joinpath(*names)
    flags |= os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o666) if dir_fd is None else open_below(dir_fd, folder, names, flags, shown=shown)
    except OSError as e:
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
