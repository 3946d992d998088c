"""Progress of long work for whoever watches it: a bar on a terminal, else one line with an estimate, so that no long
step (the features of a large split, the reference protocol's linear probe on a CPU) passes in silence."""

import sys
import time
from collections.abc import Callable, Iterable, Iterator

LONG = 30.0
"""Seconds: work estimated to take longer is announced by a line (without a bar); shorter work is not."""

Progress = Callable[[Iterable, int, str, str], Iterator]


def reporter(bar: bool) -> Progress:
    """``progress(items, total, what, unit)``: ``items`` as they come, shown by a tqdm bar on stderr (``bar``), or by
    one line once the first item is done if all ``total`` would take longer than ``LONG``: what, and about how long
    the rest takes."""
    def progress(items: Iterable, total: int, what: str, unit: str) -> Iterator:
        if bar:
            from tqdm.auto import tqdm

            yield from tqdm(items, total=total, desc=what, unit=unit, leave=False, dynamic_ncols=True)
            return
        start = time.perf_counter()
        for i, item in enumerate(items):
            yield item
            if i == 0 and (took := time.perf_counter() - start) * total > LONG:
                print(f"{what}: about {duration(took * (total - 1))} to go ({total} {unit}s, {took:.2g} s each)",
                      file=sys.stderr, flush=True)

    return progress


def duration(seconds: float) -> str:
    """``seconds`` in words: "40 s", "4.5 minutes", "3.2 hours", "9.1 days"."""
    for unit, size in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= 1.5 * size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"
