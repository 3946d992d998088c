"""Deprecated old path of the gate posterior, kept until bayesncl-pyro 0.5.0.

The gate posterior lives in ``bayesncl_pyro.evaluate.posterior`` (and ``bayesncl_pyro.gate_posterior``); this path
works until 0.5.0, with a DeprecationWarning.
"""

from bayesncl_pyro._deprecated import moved


def __getattr__(name: str):
    return moved(__name__, name)
