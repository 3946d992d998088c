"""The exception types users are meant to read.

Anything raised as ``UserError`` is a problem with the user's input (data folder, config, checkpoint)
and its message says what is wrong and how to fix it. ``experiments/run_svi.py`` prints it as one line
and exits 2; every other exception is a bug and keeps its traceback. ``Stopped`` is a run that was
asked to stop and saved its checkpoint first: by a user's Ctrl-C (SIGINT, exit 130, the shell's
convention), or by a scheduler (SIGTERM, SIGUSR1: exit ``REQUEUE``).
"""

import reprlib
import signal

# sysexits.h's EX_TEMPFAIL, "temporary failure, try again later": a run stopped by SIGTERM or SIGUSR1 (pre-emption,
# a time-limit warning) after saving its checkpoint; a batch script requeues the job on it (and slurm.conf's
# RequeueExit can name it), and rerunning the same command resumes
REQUEUE = 75


class UserError(Exception):
    """Bad input: the message names the problem and the fix."""

    def __init__(self, message: str):
        # A DataLoader worker's exception is re-raised in the main process as
        # type("Caught ... Original Traceback ... <module>.UserError: <message>"): keep the message only.
        marker = f"{type(self).__module__}.{type(self).__qualname__}: "
        super().__init__(message.rsplit(marker, 1)[-1].strip())


class Stopped(Exception):
    """Training stopped on a signal after writing its checkpoint; rerunning the command resumes it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signal.SIGINT if signum == signal.SIGINT else REQUEUE


QUOTE_LIMIT = 80  # characters of a value that a message quotes
_REPR = reprlib.Repr()  # (its limits as attributes: Python 3.11 takes no keywords)
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple, _REPR.maxset = 3, 4, 4, 4, 4
_REPR.maxstring = _REPR.maxlong = _REPR.maxother = QUOTE_LIMIT


def quoted(value) -> str:
    """``repr(value)`` for a message, at most ``QUOTE_LIMIT`` characters.

    A value read from a file (a config's, a
    run's) may be a 100 MB string, or a YAML alias bomb whose full repr would not fit in memory; reprlib stops at
    its depth and length limits before writing that much.
    """
    text = _REPR.repr(value)
    return text if len(text) <= QUOTE_LIMIT else text[:QUOTE_LIMIT - 3] + "..."


def printable(text: str) -> str:
    """``text`` with its control characters escaped.

    An eval.json from elsewhere may name a factor with terminal escape sequences (a title, a cleared screen), which the
    table would send to the terminal.
    """
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
