"""The temporary files a writer makes, and those a killed one left behind (removed only under the run's lock)."""

import contextlib
import os
import re
from pathlib import Path

from bayesncl_pyro.rundir.layout import CHECKPOINT, CONFIG, EVAL, GATES_FILE, MARKER

# the files a run replaces (save_together): a run killed while writing one leaves its <name>.<pid>.tmp
_TEMPORARY = re.compile("(" + "|".join(map(re.escape, (CHECKPOINT, CONFIG, EVAL, GATES_FILE, MARKER))) + r")\.\d+\.tmp")


def _remove_temporaries(out: Path):
    """The temporary files that runs killed mid-write (SIGKILL) left: with the folder locked, no one writes them."""
    for tmp in out.iterdir():
        if _TEMPORARY.fullmatch(tmp.name):
            with contextlib.suppress(OSError):
                tmp.unlink()


def temporary_name(name: str) -> str:
    """The temporary file that this process writes ``name`` into before it renames it: two writers never share one."""
    return f"{name}.{os.getpid()}.tmp"


_SWEPT: set[tuple[int, int, str]] = set()
"""(device, inode of a folder, file name) whose stale temporaries this process has removed (:func:`sweep`)."""


def sweep(folder: int, name: str, locked: bool):
    """Remove the temporaries of ``name`` in the folder of descriptor ``folder`` that a killed writer left.

    That is one that had this process's pid, or, ``locked`` under the run's lock (which no other writer holds), any
    process's, looked for once a file and process (a listing at every write cost 2.2 s in a folder of 400,000 files);
    a temporary of a process that died since is left for the next process.
    """
    swept = (os.fstat(folder).st_dev, os.fstat(folder).st_ino, name)
    if locked and swept not in _SWEPT:
        stale = [other for other in os.listdir(folder) if re.fullmatch(re.escape(name) + r"\.\d+\.tmp", other)]
        _SWEPT.add(swept)
    else:
        stale = [temporary_name(name)]
    for other in stale:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(other, dir_fd=folder)
