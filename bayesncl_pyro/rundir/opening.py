"""The rule of every read of a run's file: a regular file, never through a link, read up to a limit in bytes."""

import errno
import json
import os
import stat
from pathlib import Path
from typing import BinaryIO

from bayesncl_pyro.config import parse_file
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.rundir.layout import JSON_LIMIT, MAX_LINE, MAX_RECORDS, TEXT_LIMIT, logger


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
