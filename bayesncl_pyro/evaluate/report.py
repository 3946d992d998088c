"""A run's per-dimension report: one self-contained HTML page and the JSON of every number it shows.

``RUN/report/index.html`` has its images as data URIs, script and style inline and needs no network;
``RUN/report/report.json`` holds every number the page shows.

    path = write_report("runs/default", baseline="runs/ncl")   # RUN/report/index.html
    Report("runs/default")                                     # in a notebook: the page inline
    Report("runs/default").card(37)                            # one dimension's card on its own

The page has an overview (configuration, evaluation gated, with every gate open and beside the baseline, training
curves, the gate posterior, the factor-tracking table on generated data), a card per dimension in use (sortable,
filterable, rendered as the list is scrolled), a page per test image (the dimensions it uses, with q(g | x), and its
nearest neighbours with the gates and with every gate open) and the baseline's dimensions in a list of their own.
Every number the page shows is ``report_data.py``'s (``build``); the page's code is ``report_page.html`` beside this
file, and ``render`` fills in the data.
"""

import html
import json
import os
import re
from pathlib import Path

from bayesncl_pyro._deprecated import moved
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate.report_data import build
from bayesncl_pyro.rundir import (
    REPORT_DIR,
    TEXT_LIMIT,
    RunFolder,
    held,
    output_folder,
    run_folder,
    save_together,
)

_PAGE = Path(__file__).with_name("report_page.html")


def _script_json(obj) -> str:
    """JSON to sit inside a <script> element: no '<', '>' or '&' in it.

    They are written as JSON's unicode escapes (the same string to JSON.parse), so no text of the run's (a class
    folder, a path) can end the element or open a comment in it.
    """
    text = json.dumps(obj, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


_FOCUS = '<script type="application/json" id="focus">null</script>'


def render(data: dict, images: list[str]) -> str:
    """The page of a report: ``data`` (report.json's) and the test images (``thumbnails``)."""
    page = _PAGE.read_text()
    assert _FOCUS in page
    fills = {"/*TITLE*/": html.escape(f"{data['run']['method']} on {data['run']['dataset']}: {data['run']['dir']}"),
             "/*DATA*/": _script_json(data), "/*IMAGES*/": _script_json(images)}
    return re.sub(r"/\*(TITLE|DATA|IMAGES)\*/", lambda m: fills[m.group(0)], page)  # one pass: fills stay as given


def focused(page: str, view: str) -> str:
    """A rendered page that opens at one view alone (``"dim/37"``, ``"image/12"``), its navigation hidden."""
    return page.replace(_FOCUS, _FOCUS.replace("null", _script_json(view)), 1)


def write(data: dict, images: list[str], out: str | os.PathLike, named: bool = True) -> Path:
    """Write ``out/index.html`` and ``out/report.json`` together; returns the page's path.

    ``rundir.save_together``: a full disk or a signal leaves both old or both new. ``out``: the folder (``named``: one
    the user named, which may be a link; else a real folder of the run, ``rundir.output_folder``).
    """
    out = output_folder(Path(out), named)
    save_together([(json.dumps(data, separators=(",", ":"), allow_nan=False).encode() + b"\n", out / "report.json"),
                   (render(data, images).encode(), out / "index.html")])
    return out / "index.html"


def write_report(run_dir: str | os.PathLike, baseline: str | os.PathLike | None = None,
                 out: str | os.PathLike | None = None, **load) -> Path:
    """Build the report of ``run_dir`` (beside ``baseline``) and write it into ``out``.

    Into a run folder (by default, or an ``out`` inside one) under its lock, taken before the report is built
    (``rundir.held``): refused while a run trains there.

    Args:
        run_dir: the trained run folder.
        baseline: another run folder trained on the same dataset, split and seed (an NCL run), shown beside it.
        out: the folder to write into; by default ``RUN/report``.
        **load: ``trust_code`` and ``data_dir``, as :func:`~bayesncl_pyro.load_run` takes them, for both runs.

    Returns:
        The path of the page, ``out/index.html``; ``out/report.json`` beside it holds its numbers (:class:`Report`'s
        ``data``).

    Examples:
        >>> page = write_report(run_dir)  # write_report(run_dir, baseline="runs/ncl") puts an NCL run beside it
        >>> page.relative_to(run_dir).as_posix()
        'report/index.html'
    """
    target = Path(out) if out is not None else run_folder(run_dir) / REPORT_DIR
    with held(target):
        return write(*build(run_dir, baseline, **load), target, named=out is not None)


class Report:
    """A written report, for a notebook: shown inline as the page; ``card(dim)`` is one dimension's card on its own.

    ``data`` is report.json's, a dict of:

    * ``version``: the bayesncl-pyro that wrote it; ``run``: the run's ``dir``, ``method``, ``dataset``, ``config``
      (config.json's) and ``steps``;
    * ``evaluation``: the run's eval.json (None before it is evaluated), ``evaluation_columns`` its figures by
      representation, each a [column name, {metric: value}] (``heldout.by_representation``); ``gates``: the gate
      posterior's summary (gated runs; None otherwise); ``classes``: the class names;
    * ``sizes``: ``images``, ``dims``, ``dims_in_use``, ``dims_not_in_use``, ``classes``, ``min_support``,
      ``top_images``, ``thumbnail_px``; ``quantiles``: those the cards' activation quantiles are taken at;
    * ``training``: the training curves from the log; ``dims``: a card per dimension in use (``dim``, its
      activation's and inclusion's summaries, top images, most correlated dimensions, its KL, and with a baseline
      ``baseline_closest``: [its closest baseline dimension, their correlation]);
    * ``images``: a row per test image (its label, the dimensions it uses, its neighbours); ``factors``: the
      factor-tracking table on generated data (None otherwise);
    * with a baseline, ``baseline``: its ``run``, ``evaluation``, ``dims``, ``dims_not_in_use``, ``neighbours`` and
      ``note`` (a difference in training budget).

    ``page`` is index.html's, read with report.json from the same folder, opened once (``rundir.RunFolder``).

    Args:
        folder: ``RUN/report``, or the run folder holding it.
        height: the inline page's height, in pixels.

    Raises:
        UserError: ``folder`` holds no report (write one with :func:`write_report`).

    Examples:
        >>> write_report(run_dir).name
        'index.html'
        >>> report = Report(run_dir)  # a notebook cell ending in it shows the page
        >>> report.data["run"]["method"], report.data["sizes"]["dims"]
        ('bayesncl', 16)
        >>> card = report.card(report.data["dims"][0]["dim"])  # the first dimension in use, on its own
    """

    def __init__(self, folder: str | os.PathLike, height: int = 720):
        folder = Path(folder)
        with RunFolder.open(folder) as opened:  # the numbers and the page from the same folder
            inner = REPORT_DIR + "/" if opened.exists(f"{REPORT_DIR}/report.json") else ""
            self.folder = folder / inner
            if not opened.exists(f"{inner}report.json"):
                raise UserError(f"{folder} holds no report; write one with: python experiments/report.py RUN")
            self.data = opened.read_json(f"{inner}report.json", TEXT_LIMIT)
            self.page = opened.read_bytes(f"{inner}index.html", TEXT_LIMIT).decode()
        self.height = height

    def _repr_html_(self) -> str:
        return _Frame(self.page, self.height)._repr_html_()

    def card(self, dim: int, height: int = 560) -> "_Frame":
        """The card of dimension ``dim`` alone.

        Args:
            dim: a dimension in use (one of ``data["dims"]``'s ``dim``).
            height: the inline card's height, in pixels.

        Returns:
            What a notebook shows inline: the card, in a frame of its own.
        """
        if all(c["dim"] != dim for c in self.data["dims"]):
            raise UserError(f"dimension {dim} is not in use in this run (its features are zero on every test image); "
                            "pick one of report.data['dims']")
        return _Frame(focused(self.page, f"dim/{dim}"), height)


class _Frame:
    """A page shown inline in a notebook, in an iframe of its own: its script and style stay apart."""

    def __init__(self, page: str, height: int):
        self.page, self.height = page, height

    def _repr_html_(self) -> str:
        return (f'<iframe srcdoc="{html.escape(self.page, quote=True)}" style="width:100%;height:{self.height}px;'
                'border:1px solid #ccc"></iframe>')


def __getattr__(name: str):
    return moved(__name__, name)  # report.json's numbers moved to report_data (_deprecated)
