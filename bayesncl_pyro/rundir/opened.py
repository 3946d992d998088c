"""The run folders this process reads, each opened once: every file below one is read from that one descriptor.

A reader of several files of one run (the report: its checkpoint, log.jsonl, eval.json) opens the run folder once
(``RunFolder.open``, in ``reading.py``); while it is open, a read of any path below it starts from that descriptor,
so a run folder renamed, or swapped for a link to another run, between two of the reads cannot make one reader mix
the files of two folders. Kept in a context variable: a thread that did not open the folder reads by path.
"""

import contextlib
import contextvars
import os
from pathlib import Path
from typing import NamedTuple


class Opened(NamedTuple):
    """A folder open for reading: the name it was opened by (absolute, not resolved) and its descriptor."""

    named: Path
    dir: int


_OPEN: contextvars.ContextVar[tuple[Opened, ...]] = contextvars.ContextVar("bayesncl_pyro_rundir_opened", default=())


def opened(path: str | os.PathLike) -> Opened | None:
    """The innermost folder open for reading that is or holds ``path`` (by the name it was opened by), or None."""
    named = Path(os.path.abspath(path))
    found = [o for o in _OPEN.get() if o.named == named or o.named in named.parents]
    return max(found, key=lambda o: len(o.named.parts), default=None)


@contextlib.contextmanager
def reading_from(named: Path, fd: int):
    """Read every path below ``named`` from ``fd`` (a descriptor of it) meanwhile; the descriptor stays open after."""
    token = _OPEN.set((*_OPEN.get(), Opened(Path(os.path.abspath(named)), fd)))
    try:
        yield
    finally:
        _OPEN.reset(token)
