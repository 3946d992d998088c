"""The command-line programs behind experiments/*.py: each module's ``main(argv=None) -> int`` parses ``argv`` and
returns the exit status, so the scripts are a few lines and tests call ``main`` in-process."""

import functools
import sys

from bayesncl_pyro.errors import UserError


def one_line_errors(main):
    """``main`` as a script's entry point: a UserError (a bad input, with its fix) is one ``error:`` line on stderr and
    exit status 2, never a traceback; anything else is a bug and keeps its traceback."""
    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return run
