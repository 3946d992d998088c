"""The tree keeps the style pyproject.toml configures for ruff."""

import subprocess
import sys

from helpers import ROOT


def test_ruff_reports_nothing():
    """ruff (E, F, I and D with the Google convention, 120 columns: pyproject.toml's [tool.ruff]) finds nothing."""
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr
