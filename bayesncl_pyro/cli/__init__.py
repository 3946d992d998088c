"""The command-line programs behind experiments/*.py.

Each module's ``main(argv=None) -> int`` parses ``argv`` and returns the exit status, so the scripts are a few lines and
tests call ``main`` in-process.
"""

import argparse
import contextlib
import difflib
import functools
import logging
import signal
import sys

from bayesncl_pyro.errors import Stopped, UserError


def one_line_errors(main):
    """Wrap ``main`` as a script's entry point that reports the user's errors in one line.

    Never a traceback for what the user did: a UserError (a bad input, with its fix) is one ``error:`` line on stderr
    and exit status 2; a run stopped by a signal after saving its checkpoint (``Stopped``) one ``stopped:`` line and its
    exit status (130 for Ctrl-C, ``errors.REQUEUE`` for a scheduler's signal), and a Ctrl-C outside such a run
    (``KeyboardInterrupt``) ``stopped: interrupted``, exit status 130. Anything else is a bug and keeps its traceback.
    The library's messages are shown meanwhile (:func:`library_messages`).
    """
    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        try:
            with library_messages():
                return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except Stopped as e:  # under torchrun every rank says it at once into one stream: one write keeps lines whole
            sys.stderr.write(f"stopped: {e}\n")
            sys.stderr.flush()
            return e.exit_code
        except KeyboardInterrupt:
            print("stopped: interrupted", file=sys.stderr)
            return 128 + signal.SIGINT

    return run


@contextlib.contextmanager
def library_messages():
    """Show the library's log messages on stderr as a script's lines.

    Within it the ``bayesncl_pyro`` loggers' messages (notes at INFO, warnings at WARNING) are lines of their own text
    on stderr, each written out at once. Where the library is used from Python they go to Python's logging, which a
    user configures or silences.
    """
    logger = logging.getLogger("bayesncl_pyro")
    handler = logging.StreamHandler(sys.stderr)  # the stderr of now: a test's capture, a redirected stream
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@contextlib.contextmanager
def stopped_by_signals(what: str):
    """Context manager under which SIGTERM and SIGUSR1 raise ``Stopped``.

    Within it SIGTERM and SIGUSR1 (``kill``, a scheduler) raise ``Stopped`` where the program is, as Ctrl-C raises
    ``KeyboardInterrupt``, instead of ending the process on the spot: a write under way removes its temporary files
    (``rundir.save_together``) and the script ends with one ``stopped: ... received; <what>`` line. The previous
    handlers come back after.
    """
    def stop(signum, frame):
        raise Stopped(f"{signal.Signals(signum).name} received; {what}", signum)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class ArgumentParser(argparse.ArgumentParser):
    """The scripts' argument parser: whole flag names only, and a bad command line in one line with its fix.

    argparse's prefix matching would run ``--max-step 20`` as ``--max-steps 20`` and take a flag added later as another
    one, so abbreviations are refused. A command line it cannot read is one ``error:`` line, exit status 2, naming the
    closest flag to an unknown one (``--gate-densty``: did you mean ``--gate-density``?) instead of the whole usage.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        """Exit with status 2 and one line: the problem, the closest known flag to an unknown one, and --help."""
        flags = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        if message.startswith("unrecognized arguments:"):
            unknown = [w.split("=")[0] for w in message.split(":", 1)[1].split() if w.startswith("-")]
            hints = [f"{w}: did you mean {close[0]}?" for w in unknown
                     if (close := difflib.get_close_matches(w, flags, n=1, cutoff=0.6))]
            if hints:
                message += f" ({'; '.join(hints)})"
        self.exit(2, f"error: {message}; {self.prog} --help lists the flags\n")
