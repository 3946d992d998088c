"""experiments/inspect_gates.py's figures say what they show: top_images.png ranks only dimensions active in enough
images and labels each row by its images, elbo.png's titles fit and name no gates for NCL, kl_per_dim.png stays
readable at K = 256, and the summary's "mostly gated" counts come from one split."""

from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from PIL import Image

from bayesncl_pyro.evaluate import dimensions as dm
from bayesncl_pyro.evaluate import figures
from bayesncl_pyro.evaluate.diagnostics import conflict_lines
from bayesncl_pyro.infer.estimators import GateEstimator, gate_class


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plot functions draw, drawn and kept open (instead of saved)."""
    kept = []

    def keep(fig, path):
        if fig.get_layout_engine() is None:
            fig.tight_layout()
        fig.canvas.draw()
        kept.append(fig)
        return path

    monkeypatch.setattr(figures, "save", keep)
    yield kept
    matplotlib.pyplot.close("all")


def _features(columns: list[tuple[list[int], list[float]]], n: int) -> torch.Tensor:
    """N x K features with column k non-zero on the given images at the given values."""
    f = torch.zeros(n, len(columns))
    for k, (images, values) in enumerate(columns):
        f[images, k] = torch.tensor(values)
    return f


def test_top_images_ranks_only_dims_with_enough_support_and_labels_rows_by_their_images(drawn):
    n, labels = 400, torch.arange(400) % 4  # 4 classes of 100: a dimension needs 25 active images
    lucky = ([0, 4, 8, 12, 16, 20], [1.0] * 6)  # 6 images, all class 0: consistent by chance
    # 40 images: 24 of class 1 at low values, and its 10 strongest all of class 2
    strong = [2 + 4 * j for j in range(10)]
    broad = ([1 + 4 * j for j in range(24)] + strong + [3 + 4 * j for j in range(6)],
             [0.1] * 24 + [0.9] * 10 + [0.2] * 6)
    f = _features([lucky, broad], n)
    assert dm.min_support(n, 4) == 25
    assert dm.consistent_dims(f, labels, 4, 8) == [1]  # the 6-image dimension is not ranked at all
    dataset = [(torch.zeros(3, 4, 4, dtype=torch.uint8), int(y)) for y in labels]
    figures.plot_top_images(f, labels, dataset, ["a", "b", "c", "d"], Path("unused.png"), per_dim=10)
    label = drawn[0].axes[0].get_ylabel()
    assert label.startswith("dim 1: 10 of 10 'c'")  # what the row shows
    assert "of its 40 active" in label and "60% 'b'" in label  # and, said as such, its consistency


def _inside_and_apart(fig) -> None:
    box = fig.bbox
    titles = [ax.title.get_window_extent() for ax in fig.axes]
    for t in titles:
        assert box.x0 <= t.x0 and t.x1 <= box.x1 and t.y1 <= box.y1, "a title is cut off"
    for a, b in zip(titles, titles[1:]):
        assert a.x1 <= b.x0, "two titles overlap"


def test_elbo_titles_fit_and_name_no_gates_for_ncl(drawn):
    log = [dict(step=s, loss=5.0 - s / 100, nce=5.0 - s / 100, kl=13.0) for s in range(1, 30)]
    figures.plot_elbo(log, gate_class("ste"), 3e-5, Path("unused.png"))
    figures.plot_elbo(log, None, 3e-5, Path("unused.png"))
    gated, ncl = drawn
    assert len(gated.axes) == 3 and len(ncl.axes) == 1
    assert "surrogate" in gated.axes[0].get_title() and "not -ELBO" in gated.axes[0].get_title()  # what ste trained
    for fig in drawn:
        _inside_and_apart(fig)
    title = ncl.axes[0].get_title()
    assert "InfoNCE" in title and not any(w in title.lower() for w in ("lambda", "kl", "gate", "elbo"))


def test_kl_per_dim_stays_readable_at_k_256(tmp_path):
    kl = np.random.default_rng(0).gamma(2.0, 0.05, size=256)
    path = figures.plot_kl_per_dim(kl, GateEstimator.kl_label(0.01), tmp_path / "kl.png")
    width, height = Image.open(path).size
    assert width <= 1000 and height <= 500  # was 3379 x 374 px


def test_the_summarys_mostly_gated_counts_come_from_one_split():
    """The conflict lines group dimensions by the test split's mean inclusion, as the gate line counts them, not by
    the training batches' ``incl`` of conflict.jsonl."""
    k = 6
    table = dict(cancellation=np.full(k, 0.5), oscillation=np.ones(k), sign_flips=np.zeros(k),
                 freq=np.linspace(0.1, 0.9, k), incl=np.full(k, 0.9))  # every dim open on the training batches
    probs = torch.tensor([[0.2, 0.3, 0.4, 0.6, 0.7, 0.8]]).repeat(10, 1)  # 3 of 6 gated on the test split
    lines = conflict_lines("bayesncl", table, dm.mostly_gated(probs).numpy())
    assert "  mostly gated on the test split: 3 dims" in [line.split(",")[0] for line in lines]


def test_the_conflict_figures_log_axis_reads_as_text_and_no_panel_is_squeezed():
    """the log axis printed raw mathtext (the module sets text.parse_math off), whose width pushed
    the middle panel away from the first."""
    rng = np.random.default_rng(0)

    def table():
        return dict(freq=rng.uniform(0, 1, 64), cancellation=rng.uniform(0.5, 1, 64),
                    oscillation=10 ** rng.uniform(0, 5, 64), sign_flips=rng.uniform(0, 0.5, 64),
                    incl=rng.uniform(0, 1, 64))

    fig = figures.conflict_figure(table(), "bayesncl", table(), "ncl")
    fig.canvas.draw()
    panels = fig.axes[:3]
    labels = [t.get_text() for ax in panels for t in ax.get_yticklabels() + ax.get_xticklabels() if t.get_visible()]
    assert labels and not any("$" in t or "mathdefault" in t for t in labels)
    assert {"10⁰", "10²", "10⁴"} <= {t.get_text() for t in panels[1].get_yticklabels()}
    boxes = [ax.get_position() for ax in panels]
    for left, right in zip(boxes, boxes[1:]):
        assert right.x0 - left.x1 < 0.3 * boxes[0].width  # the gap between panels: 0.8 of a panel on main
    matplotlib.pyplot.close(fig)


def test_a_baseline_of_another_length_or_without_conflict_is_said(tmp_path, bayes_run, ncl_run):
    """the summary compared runs of different lengths without a word, and silently left out a
    baseline with one conflict record."""
    import json
    import shutil

    base = tmp_path / "ncl"
    shutil.copytree(ncl_run, base)
    log = [json.loads(line) for line in (base / "log.jsonl").read_text().splitlines()]
    log[-1]["step"] = 20
    (base / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    first = (base / "conflict.jsonl").read_text().splitlines()[0]
    (base / "conflict.jsonl").write_text(first + "\n")
    summary = figures.inspect(bayes_run, tmp_path / "figures", baseline=base)
    steps = json.loads((bayes_run / "log.jsonl").read_text().splitlines()[-1])["step"]
    assert f"note: the baseline (ncl) trained 20 steps and this run (bayesncl) {steps}" in summary[1]
    assert any(f"the baseline {base} has 1 conflict record(s)" in line and "left out" in line for line in summary)
