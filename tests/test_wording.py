"""RESULTS.md and the README read an interval that holds zero as what it is: no separation, never a sameness.

A 95 % interval of a paired difference that contains 0 does not show two methods equal; only an equivalence test
within a declared margin could, and the sentence then quotes it. So a sentence that quotes such an interval may not
call the two the same.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SAMENESS = re.compile(
    r"\b(look(s)? the same|the same as|is the same|are the same|equals?|equal to|level with|no difference|"
    r"NCL's level|is NCL's|are NCL's|indistinguishable|identical|on par|matches)\b", re.I)
"""Words that read a difference as none."""

INTERVAL = re.compile(r"\[([+-]?\d+(?:\.\d+)?), ([+-]?\d+(?:\.\d+)?)\]")
"""A quoted interval, [low, high]."""


def sentences(text: str) -> list[str]:
    """The text's sentences, code blocks and table rows left out, each on one line."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    prose = " ".join(line for line in text.splitlines() if not line.lstrip().startswith("|"))
    return [s.strip() for s in re.split(r"(?<=\.)\s+(?=[A-Z(*-])", prose) if s.strip()]


def sameness_beside_zero(text: str) -> list[str]:
    """The sentences that use a word of :data:`SAMENESS` beside an interval holding 0: in it, or in the sentence before
    or after it (a sentence may quote the interval and the next one read it)."""
    found = sentences(text)
    out = []
    for i, s in enumerate(found):
        if any(float(lo) <= 0 <= float(hi) for lo, hi in INTERVAL.findall(s)):
            out += [n for n in found[max(0, i - 1):i + 2] if SAMENESS.search(n) and n not in out]
    return out


def test_the_check_finds_a_sameness_next_to_an_interval_holding_zero():
    assert sameness_beside_zero("Against NCL (-0.1 [-1.7, +1.5]) they look the same. Next.")
    assert sameness_beside_zero("Against NCL -0.1 [-1.7, +1.5]. So the seeds find no difference.")  # the next one
    assert sameness_beside_zero("Its consistency equals NCL's (-0.1 [-1.7, +1.5]).")
    assert not sameness_beside_zero("Against NCL (-0.1 [-1.7, +1.5]) the seeds do not separate them.")
    assert not sameness_beside_zero("Above NCL (+1.2 [+0.3, +2.0]), the same seeds.")  # the interval excludes zero


@pytest.mark.parametrize("page", ["README.md", "docs/RESULTS.md"])
def test_no_interval_that_holds_zero_is_read_as_sameness(page):
    found = sameness_beside_zero((ROOT / page).read_text())
    assert not found, f"{page} reads an interval holding 0 as sameness:\n" + "\n".join(found)
