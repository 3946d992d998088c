"""The files a run appends to (log.jsonl, conflict.jsonl): whole lines, and cut back to a checkpoint's step."""

import json
import os
from pathlib import Path

from bayesncl_pyro.errors import UserError
from bayesncl_pyro.rundir.commit import cannot_write
from bayesncl_pyro.rundir.layout import TEXT_LIMIT
from bayesncl_pyro.rundir.opening import _open


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


def cut_records(path: Path, step: int) -> bool:
    """Cut a run's ``.jsonl`` file back to its records up to ``step``, the step of the checkpoint a run resumes from.

    A run killed after its checkpoint had logged the steps it then takes again: kept, they would stand twice, and what
    reads them (eval.json's ``conflict_*``) would differ from an uninterrupted run's. The file ends after the last
    record up to ``step`` before the first one past it; what follows, a line that a kill cut short too, goes. Called
    under the run's lock, before the run appends. Returns whether it held a record past ``step`` (a W&B run then
    holds it too: ``loggers.WandbLog`` rewinds it).
    """
    if not os.path.lexists(path):
        return False
    try:
        fd = _open(path, os.O_RDWR)
        try:
            keep, end, past = 0, 0, False
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
                            past = True
                            break
                        keep = end
            if keep < os.fstat(fd).st_size:
                os.ftruncate(fd, keep)
                os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise UserError(cannot_write(path, e)) from None
    return past
