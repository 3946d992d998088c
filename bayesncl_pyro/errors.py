"""The one exception type users are meant to read.

Anything raised as ``UserError`` is a problem with the user's input (data folder, config, checkpoint)
and its message says what is wrong and how to fix it. ``experiments/run_svi.py`` prints it as one line
and exits non-zero; every other exception is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: the message names the problem and the fix."""
