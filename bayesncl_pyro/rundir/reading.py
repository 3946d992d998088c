"""A run folder opened once by a reader of several of its files: every one read from the same folder.

    with RunFolder.open("runs/x") as run:
        state = run.load_checkpoint()
        log, evaluation = run.read_log(), run.read_eval(gate)   # from the folder whose checkpoint was read

Each read of a run's file opens the file below a descriptor of its run folder, never through a link; without a
folder held open, that descriptor is opened by the run folder's path at each read, so a run folder swapped for a link
to another run (or renamed, and another put in its place) between two reads would give one reader the files of two
runs. While a ``RunFolder`` is open, every read of a path below it (``read_json``, ``read_log``, ``load_checkpoint``,
``evaluate.loading.load_learner``, ...: the readers that take paths) starts from its one descriptor.
"""

import contextlib
import os
import weakref
from pathlib import Path
from typing import BinaryIO

from bayesncl_pyro.errors import UserError
from bayesncl_pyro.rundir.artefacts import load_checkpoint, read_eval, read_log
from bayesncl_pyro.rundir.beneath import open_below, open_beneath
from bayesncl_pyro.rundir.layout import CHECKPOINT, JSON_LIMIT, _below_run
from bayesncl_pyro.rundir.locking import held_open
from bayesncl_pyro.rundir.opened import reading_from
from bayesncl_pyro.rundir.opening import exists, open_file, read_bytes, read_json, read_records

_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def _open_folder(path: Path) -> int:
    """A descriptor of the folder ``path``, opened for reading.

    A run folder, or a folder outside any, is opened by the path as named (a link the user names may lead to a run
    kept elsewhere); a folder inside a run folder (``RUN/report``) is reached from the run folder without following a
    link, as every read of a run's file is.
    """
    place = _below_run(path)
    if place is None or not place[1]:
        return os.open(path, _FOLDER)
    run, names = place
    base = os.open(run, _FOLDER)
    try:
        return open_below(base, run, names, _FOLDER, kind="folder")
    finally:
        os.close(base)


class RunFolder:
    """A run folder (or any folder a reader reads several files of) held open by one descriptor.

    ``RunFolder.open(path)``; as a context manager, every read of a path below it meanwhile goes through that
    descriptor, and the descriptor is closed at its end. Its methods read the run's files by name (``run.read_json(
    "config.json")``) whether or not it is entered. ``path``: the folder as it was named.

    The folder is opened by the path the user names, which may be a link (to a run kept elsewhere); what lies below
    it is read through no link. Where this process holds the run's lock, its descriptor is the one the lock opened
    (the folder it writes into); a folder that does not exist (or is no folder) is held by no descriptor, and reads
    go by path, to the readers' own messages (a run folder without its checkpoint, ...).
    """

    def __init__(self, path: Path, fd: int | None):
        self.path, self.dir = path, fd
        self._entered: list = []
        if fd is not None:
            self._closer = weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "RunFolder":
        """Open the folder ``path`` (a run folder, a record of one, a report's folder) once, for reading."""
        path = Path(path)
        named = Path(os.path.abspath(path))
        # the innermost folder this process reads or locked already: the same folder, however long ago it was opened
        mine = held_open(named)
        try:
            if mine is None:
                fd = _open_folder(path)
            elif mine.named == named:
                fd = os.dup(mine.dir)
            else:
                fd = open_beneath(mine.dir, named.relative_to(mine.named).parts, _FOLDER)
        except (FileNotFoundError, NotADirectoryError):
            fd = None
        except OSError as e:
            raise UserError(f"cannot read {path}: {e.strerror or e}") from None
        return cls(path, fd)

    def close(self):
        """Close the descriptor (a closed folder reads by path again); while entered, at the end of the ``with``."""
        if self.dir is not None and not self._entered:
            self._closer()
            self.dir = None

    def __enter__(self) -> "RunFolder":
        self._entered.append(self._reading())
        self._entered[-1].__enter__()
        return self

    def __exit__(self, *exc):
        self._entered.pop().__exit__(*exc)
        if not self._entered:
            self.close()

    def _reading(self):
        """Read below :attr:`path` from the descriptor meanwhile (a no-op without one)."""
        return reading_from(self.path, self.dir) if self.dir is not None else contextlib.nullcontext()

    def file(self, name: str) -> Path:
        """The path of the file ``name`` (``"config.json"``, ``"report/index.html"``) in the folder, as named."""
        return self.path / name

    def exists(self, name: str) -> bool:
        """Whether the folder holds ``name`` (a link too: reading it is refused, naming it)."""
        with self._reading():
            return exists(self.file(name))

    def open_file(self, name: str, limit: int) -> BinaryIO:
        """The file ``name``, open for reading (``rundir.open_file``)."""
        with self._reading():
            return open_file(self.file(name), limit)

    def read_bytes(self, name: str, limit: int) -> bytes:
        """The content of the file ``name``, at most ``limit`` bytes (``rundir.read_bytes``)."""
        with self._reading():
            return read_bytes(self.file(name), limit)

    def read_json(self, name: str, limit: int = JSON_LIMIT):
        """The JSON document in the file ``name`` (``rundir.read_json``)."""
        with self._reading():
            return read_json(self.file(name), limit)

    def read_records(self, name: str) -> list[dict]:
        """The records of the ``.jsonl`` file ``name`` (``rundir.read_records``; empty if there is none)."""
        with self._reading():
            return read_records(self.file(name))

    def read_log(self) -> list[dict]:
        """The records of the run's ``log.jsonl`` (``rundir.read_log``)."""
        with self._reading():
            return read_log(self.path)

    def read_eval(self, gate: str | None = None) -> dict:
        """The run's ``eval.json``, in today's terms (``rundir.read_eval``)."""
        with self._reading():
            return read_eval(self.path, gate)

    def load_checkpoint(self) -> dict:
        """The run's ``checkpoint.pt``, weights-only (``rundir.load_checkpoint``)."""
        with self._reading():
            return load_checkpoint(self.file(CHECKPOINT))
