"""The rule of every read of a run's file: a regular file, never through a link, read up to a limit in bytes."""

import errno
import json
import os
import stat
from pathlib import Path
from typing import BinaryIO

from bayesncl_pyro.config import parse_file
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.rundir.beneath import open_beneath, open_regular
from bayesncl_pyro.rundir.layout import JSON_LIMIT, MAX_LINE, MAX_RECORDS, TEXT_LIMIT, _below_run, logger
from bayesncl_pyro.rundir.locking import held_open


def _place(path: Path) -> tuple[int, Path, tuple[str, ...]]:
    """Where a file of a run is opened from: a descriptor of a folder, that folder, and the names from it to the file.

    The folder is the run folder this process locked, by the descriptor opened then (as every write into it), or one
    it opened for reading (``RunFolder.open``), by that descriptor: the innermost of the two; else the run folder that
    holds the file (:func:`run_holding`), opened now by its path, which the user names and which may be a link; else
    the file's own folder. Every name below it is opened without following a link.
    """
    named = Path(os.path.abspath(path))
    mine = held_open(named.parent)
    if mine is not None:
        return os.dup(mine.dir), mine.named, named.relative_to(mine.named).parts
    folder, names = _below_run(named.parent) or (named.parent, ())
    return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), folder, (*names, named.name)


def _open(path: Path, flags: int, follow: bool = False) -> int:
    """Return ``os.open(path, flags)`` of a regular file, by the run folder's rule (:func:`beneath.open_regular`).

    It is opened below its run folder's descriptor (:func:`_place`), no name on the way a symbolic link; ``follow``:
    a file the user named, opened by its path, may be one.
    """
    path = Path(path)
    if follow:
        return open_regular(None, path.parent, (path.name,), flags, follow=True, shown=path)
    fd, folder, names = _place(path)
    try:
        return open_regular(fd, folder, names, flags, shown=path)
    finally:
        os.close(fd)


def exists(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a file (of any kind, a link too), looked up where :func:`open_file` would open it.

    Below a run folder open for reading or locked, in that folder, even if the path now leads elsewhere; a link on
    the way counts as there (the read refuses it, naming it).
    """
    try:
        fd, _, names = _place(Path(path))
    except (FileNotFoundError, NotADirectoryError):  # no folder to hold it
        return False
    try:
        os.close(open_beneath(fd, names, os.O_PATH | os.O_CLOEXEC))
    except OSError as e:  # a link on the way: ELOOP, or (a name at a time, O_DIRECTORY) ENOTDIR, as a file there
        return e.errno == errno.ELOOP or e.errno == errno.ENOTDIR and _linked_on_the_way(fd, names)
    finally:
        os.close(fd)
    return True


def _linked_on_the_way(dir_fd: int, names: tuple[str, ...]) -> bool:
    """Whether a folder on the way from ``dir_fd`` to ``names`` is a symbolic link (rather than a file, or missing)."""
    for i in range(1, len(names)):
        try:
            fd = open_beneath(dir_fd, names[:i], os.O_PATH | os.O_CLOEXEC)
        except OSError:
            return False
        mode = os.fstat(fd).st_mode
        os.close(fd)
        if stat.S_ISLNK(mode):
            return True
    return False


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
    if not exists(path):
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
