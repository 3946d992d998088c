"""The per-dimension report (experiments/report.py, bayesncl_pyro/evaluate/report.py): report.json's invariants and its
agreement with eval.json, a page that needs nothing from outside, and the page in a real browser (Debian's
Chromium, driven by Playwright), at the size of a tiny run and at ImageNet-100's on the benchmark's stand-in."""

import json
import re
from html.parser import HTMLParser

import pytest
import torch
from helpers import TINY_RUN

from bayesncl_pyro.cli import bench_report, run_svi
from bayesncl_pyro.data import load_dataset
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate import dimensions as dm
from bayesncl_pyro.evaluate import heldout, report, report_data
from bayesncl_pyro.evaluate.loading import load_learner
from bayesncl_pyro.evaluate.posterior import gate_posterior
from bayesncl_pyro.infer.estimators import GateEstimator
from bayesncl_pyro.rundir import read_eval
from bayesncl_pyro.train.trainer import Trainer

# the compositional benchmark (factors recorded), a few steps: 1280 test images, K = 16
TINY_COMPOSITIONAL = [a if a != "digits" else "compositional" for a in TINY_RUN] + ["--max-steps", "3",
                                                                                   "--train-subset", "256"]
SIZE_BUDGET_MB = 40  # the page of a K = 2048, 5,000-image run with 64 px thumbnails (docs/PERFORMANCE.md)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(BayesNCL run, NCL run, its report folder, report.json) on the compositional benchmark."""
    root = tmp_path_factory.mktemp("report")
    bayes, ncl = root / "bayesncl", root / "ncl"
    for args in ([*TINY_COMPOSITIONAL, "--out", str(bayes)],
                 [*TINY_COMPOSITIONAL, "--method", "ncl", "--out", str(ncl)]):
        Trainer(run_svi.config(args)[0], progress=False).fit().evaluate()  # checkpoint and eval.json: what it reads
    page = report.write_report(bayes, ncl)
    return bayes, ncl, page.parent, json.loads(page.with_name("report.json").read_text())


def _cards_are_sound(cards, n, gated):
    for c in cards:
        assert 0 <= c["frequency"] <= 1 and c["frequency"] == pytest.approx(c["support"] / n, rel=1e-3)
        assert sum(c["class_counts"]) == c["support"] == sum(c["activation_hist"])
        assert 0 <= c["consistency"] <= 1
        images = [e[0] for e in c["top"] + c["quantiles"] + c.get("top_ungated", [])]
        assert all(0 <= i < n for i in images)
        values = [e[1] for e in c["top"]]
        assert values == sorted(values, reverse=True) and len(c["top"]) == min(report_data.TOP_IMAGES, c["support"])
        # quantiles ordered: levels and the activations at them ascend
        levels, acts = [q[0] for q in c["quantiles"]], [q[2] for q in c["quantiles"]]
        assert levels == sorted(levels) and acts == sorted(acts) and (not acts or acts[-1] <= values[0])
        assert all(j != c["dim"] for j, _ in c["correlated"])
        if gated:
            assert all(0 <= e[2] <= 1 for e in c["top"] + c["top_ungated"])
            assert sum(c["inclusion_hist"]) == n and 0 <= c["mean_inclusion"] <= 1
            ungated = [e[1] for e in c["top_ungated"]]
            assert ungated == sorted(ungated, reverse=True)


def test_report_json_invariants_and_eval_json(runs):
    bayes, ncl, _, data = runs
    ev = read_eval(bayes)
    n, k = data["sizes"]["images"], data["sizes"]["dims"]
    dims = [c["dim"] for c in data["dims"]]
    # one card per dimension in use, as eval.json counts them; the rest are counted
    assert dims == sorted(set(dims)) and len(dims) == ev["active_dims"] == data["sizes"]["dims_in_use"]
    assert data["sizes"]["dims_not_in_use"] == k - len(dims)
    _cards_are_sound(data["dims"], n, gated=True)
    # numbers that eval.json reports too, to report.json's 4 significant digits
    used = [c for c in data["dims"] if c["support"]]
    assert sum(c["consistency"] for c in used) / len(used) == pytest.approx(ev["semantic_consistency"], abs=1e-3)
    assert sum(c["frequency"] for c in data["dims"]) / len(dims) == pytest.approx(ev["activation_rate"], abs=1e-3)
    assert data["gates"]["gates_open"] == pytest.approx(ev["gates_open"], rel=1e-3)
    assert data["evaluation"] == ev
    rows = data["factors"]["rows"]
    for name in ("class", "background"):
        assert sum(r["tracks"] == name for r in rows) == ev[f"dims_tracking_{name}"]
        assert sum(r["tracks_ungated"] == name for r in rows) == ev[f"ungated_dims_tracking_{name}"]
        closed = sum(r["tracks_ungated"] == name and r["gates_closed"] > 0.5 for r in rows)
        assert closed == ev[f"gated_off_dims_{name}"]
    assert data["factors"]["values"]["background"] == ["sky", "grass", "sand", "wall"]
    # every image: its class, factors, neighbours (never itself) and top dims inside the split
    images = data["images"]
    assert len(images["labels"]) == len(images["top_dims"]) == len(images["mask_flip_share"]) == n
    assert len(images["factors"]["background"]) == n
    for i, (near, open_near) in enumerate(zip(images["neighbours"], images["neighbours_ungated"])):
        assert i not in near and i not in open_near and all(0 <= j < n for j in near + open_near)
    assert all(0 <= d < k and 0 <= q <= 1 for row in images["top_dims"] for d, _, q in row)
    assert all(0 <= s <= 1 for s in images["mask_flip_share"])
    # each image's uncertainty: the posterior's novelty scores and their percentiles in the split
    assert len(images["kl_prior"]) == len(images["gate_entropy"]) == n
    assert min(images["kl_prior_percentile"]) == 0 and max(images["kl_prior_percentile"]) == 1
    top = max(range(n), key=images["gate_entropy_percentile"].__getitem__)
    assert images["gate_entropy"][top] == max(images["gate_entropy"])  # the top percentile is the largest entropy
    # the baseline: its own list, the same split; its eval beside
    base = data["baseline"]
    assert len(base["dims"]) == read_eval(ncl)["active_dims"] and base["run"]["method"] == "ncl"
    _cards_are_sound(base["dims"], n, gated=False)
    assert "mean_inclusion" not in base["dims"][0] and base["evaluation"] == read_eval(ncl)
    base_dims = {c["dim"] for c in base["dims"]}
    assert all(c["baseline_closest"][0] in base_dims and -1 <= c["baseline_closest"][1] <= 1 for c in data["dims"])
    # training curves as logged; the log's loss is its nce + lambda * kl
    log = [json.loads(line) for line in (bayes / "log.jsonl").read_text().splitlines()]
    assert data["training"]["step"] == [r["step"] for r in log]
    assert data["training"]["loss_is_nce_plus_weighted_kl"] < 1e-5
    assert "surrogate" in data["training"]["objective"] and "not -ELBO" in data["training"]["objective"]  # ste's


def test_the_report_and_the_posterior_agree(runs):
    """Inclusion by class is GatePosterior's class_means; mask stability, exact in the report, is what draws from q
    (through bayesncl_pyro.evaluate.posterior) give; top images and class counts are what inspect_gates ranks by."""
    bayes, _, _, data = runs
    learner, cfg = load_learner(bayes)
    spec = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed)
    post = gate_posterior(learner, spec, num_draws=400)
    feats = heldout.test_features(learner, spec)
    torch.testing.assert_close(dm.inclusion_by_class(feats.probs, feats.labels, 8)[0], post.class_means)
    for c in data["dims"][:4]:
        got = [m for m, _ in c["class_inclusion"]]
        assert got == pytest.approx(post.class_means[:, c["dim"]].tolist(), abs=1e-3)
    flips = (post.draws != feats.mask).float().mean((0, 2))  # Monte Carlo over 400 draws
    exact = torch.tensor(data["images"]["mask_flip_share"])
    assert (flips - exact).abs().max() < 0.03
    assert data["gates"]["mask_flip_share"] == pytest.approx(float(flips.mean()), abs=2e-3)


class _Assets(HTMLParser):
    """Every attribute that could load something, and the tags that load by name."""

    def __init__(self):
        super().__init__()
        self.refs, self.tags = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self.refs += [v for a, v in attrs if a in ("src", "href", "srcset", "poster", "data", "action") and v]


def test_the_page_is_one_self_contained_file(runs):
    _, _, folder, _ = runs
    page = (folder / "index.html").read_text()
    assert not re.search(r"https?://", page, re.IGNORECASE)
    parser = _Assets()
    parser.feed(page)
    assert all(ref.startswith(("#", "data:")) for ref in parser.refs), parser.refs
    assert not [t for t, a in parser.tags
                if t in ("link", "iframe", "object", "embed") or (t == "script" and "src" in a)]
    assert "@import" not in page and not re.search(r"url\((?!data:)", page)
    # the images live in the page, one data URI per test image, and nothing else sits beside it
    assert sorted(p.name for p in folder.iterdir()) == ["index.html", "report.json"]


def test_a_baseline_on_other_data_and_a_missing_run_are_refused(runs, tmp_path, ncl_run):
    bayes, _, _, _ = runs
    with pytest.raises(UserError, match="trained on digits"):
        report_data.build(bayes, ncl_run)
    with pytest.raises(UserError, match="no checkpoint.pt"):
        report_data.build(tmp_path / "nowhere")
    with pytest.raises(UserError, match="holds no report"):
        report.Report(tmp_path)


def test_a_card_on_its_own_for_the_notebook(runs):
    bayes, _, _, data = runs
    shown = report.Report(bayes)
    k = data["dims"][0]["dim"]
    frame = shown.card(k)._repr_html_()
    assert frame.startswith("<iframe srcdoc=") and f"&quot;dim/{k}&quot;" in frame
    assert "<iframe srcdoc=" in shown._repr_html_()
    with pytest.raises(UserError, match="not in use"):
        shown.card(10_000)


# -- in a browser ----------------------------------------------------------------------------------------------


def test_in_chromium_cards_sort_filter_and_open_an_image(runs, tab, tmp_path):
    _, _, folder, data = runs
    tab.open(folder / "index.html", "#dims")
    cards = data["dims"]
    assert tab.scroll_all() and sorted(tab.dims()) == sorted(c["dim"] for c in cards)
    assert f"{len(cards)} of {len(cards)} dims in use match" in tab.page.inner_text("#view-dims .count")
    # every image in the cards is a data URI with its class and background as caption, q(g | x) on hover
    first = tab.page.locator("#view-dims .card").first
    assert first.locator("img").first.get_attribute("src").startswith("data:image/")
    tip = first.locator("figure.thumb").first.get_attribute("title")
    k = tab.dims()[0]
    i = next(c for c in cards if c["dim"] == k)["top"][0][0]
    assert tip.startswith(f"test image {i}: {data['classes'][data['images']['labels'][i]]} \u00b7 ")
    assert f"q(g_{k} = 1 | x) = " in tip
    # a chart's bar says what it is on hover
    box = first.locator("svg[data-tips]").first.bounding_box()
    tab.page.mouse.move(box["x"] + 3, box["y"] + box["height"] / 2)
    assert tab.page.locator("#tip").inner_text() == f"{data['classes'][0]}: active in " + \
        f"{next(c for c in cards if c['dim'] == k)['class_counts'][0]} images"
    # sorting by a column reorders the cards as report.json says
    by_consistency = tab.dims()
    tab.page.select_option("#view-dims .sort", "frequency")
    tab.scroll_all()
    by_frequency = tab.dims()
    expected = [c["dim"] for c in sorted(cards, key=lambda c: (-c["frequency"], c["dim"]))]
    assert by_frequency == expected and by_frequency != by_consistency
    # a filter hides cards
    least = sorted(c["support"] for c in cards)[len(cards) // 2]
    tab.page.fill("#view-dims .min", str(least))
    tab.scroll_all()
    assert sorted(tab.dims()) == sorted(c["dim"] for c in cards if c["support"] >= least)
    assert len(tab.dims()) < len(cards)
    tab.page.fill("#view-dims .min", "0")
    tab.page.select_option("#view-dims .factor", "background")
    assert set(tab.scroll_all()) == {c["dim"] for c in cards if c["tracked"] == "background"}
    # a correlated dimension's link opens its card; an image opens its page
    j = cards[0]["correlated"][0][0]
    tab.open(folder / "index.html", f"#dim/{cards[0]['dim']}")
    tab.follow(f"#view-card a[href='#dim/{j}']")
    assert tab.dims("#view-card") == [j]
    tab.follow("#view-card figure.thumb >> nth=0")
    assert tab.page.locator("#view-image h2").inner_text().startswith("Test image")
    assert "its uncertainty" in tab.page.locator("#view-image").inner_text()
    assert tab.page.locator("#view-image figure.thumb").count() == 3 * report_data.NEIGHBOURS  # F, open, baseline
    tab.open(folder / "index.html", f"#dim/{cards[0]['dim']}")
    tab.follow("#view-card a[href^='#baseline-dim/']")  # the baseline's closest dimension, beside
    assert tab.dims("#view-card") == [cards[0]["baseline_closest"][0]]
    tab.open(folder / "index.html", "#baseline")
    assert sorted(tab.scroll_all("#view-baseline")) == sorted(c["dim"] for c in data["baseline"]["dims"])
    tab.open(folder / "index.html", "#overview")
    assert tab.page.locator("table.factors tbody tr").count() == len(data["factors"]["rows"])
    # the evaluation: one column a representation, one row a metric (it was a row for each suffixed key)
    cells = tab.page.evaluate("() => [...document.querySelectorAll('#view-overview tr')].map(r => [...r.children]"
                              ".map(c => c.innerText))")
    assert next(r for r in cells if r[:2] == ["metric", "gated (F)"])[2:] == [
        "every gate open", "q's mean", "q draws", "random mask", "baseline (ncl)"]
    ev, row = data["evaluation"], next(r for r in cells if r[0] == "semantic_consistency")
    assert [float(x) for x in row[1:6]] == pytest.approx([ev[k] for k in (
        "semantic_consistency", "semantic_consistency_ungated", "semantic_consistency_posterior_mean",
        "semantic_consistency_q_draws", "semantic_consistency_random_mask")], rel=1e-3)
    assert not any(r[0].endswith(("_ungated", "_posterior_mean", "_q_draws", "_random_mask")) for r in cells)
    factor = next(r for r in cells if r[0] == "background")  # the factor counts: F's, u's, those the gates close
    assert factor[1:] == [str(ev[k]) for k in ("dims_tracking_background", "ungated_dims_tracking_background",
                                                "gated_off_dims_background")]
    shot = tmp_path / "report.png"
    tab.page.screenshot(path=str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert tab.errors == []
    assert all(u.startswith(("file:", "data:")) for u in tab.requests), [u for u in tab.requests if "data:" not in u]


def test_the_gates_that_never_left_one_half_are_warned_about(runs, tab):
    """Three steps leave every q(g = 1 | x) near 0.5: the page says so at its top."""
    _, _, folder, data = runs
    assert data["gates"]["undecided_share"] >= 0.9 and data["gates"]["warning"].startswith("the gates never left 0.5")
    tab.open(folder / "index.html")
    assert tab.page.locator("#undecided").inner_text().startswith("the gates never left 0.5")
    assert tab.errors == []


def test_the_gates_panel_names_the_prior_only_where_the_config_has_one(runs, tab, tmp_path):
    """A run's page says which --prior its rate is from; a page whose config names none (the benchmark's stand-in)
    gives the rate alone, not "--prior undefined"."""
    _, _, folder, _ = runs
    tab.open(folder / "index.html")
    assert "(--prior bernoulli)" in tab.page.inner_text("body")
    feats = bench_report.stand_in(200, 16, 4)
    kl = dm.kl_per_dim(feats.probs, torch.full((16,), 0.8), 0.01)
    run = bench_report.stand_in_run(16)
    del run["config"]["prior"]
    gates = report_data.gate_summary(feats, kl, GateEstimator.kl_label(0.01), 0.8)
    data = report_data.report_data(feats, run, gates=gates, kl=kl)
    tab.open(report.write(data, report_data.thumbnails(bench_report.stand_in_images(200)), tmp_path))
    text = tab.page.inner_text("body")
    assert re.search(r"prior rate 0\.80*;", text) and "--prior" not in text and "undefined" not in text
    assert tab.errors == []


@pytest.fixture(scope="module")
def imagenet100_sized(tmp_path_factory):
    """The benchmark's stand-in run (K = 2048, 5,000 test images of 100 classes, 64 px thumbnails): (page, data)."""
    feats = bench_report.stand_in(5000, 2048, 100)
    kl = dm.kl_per_dim(feats.probs, torch.full((2048,), 0.8), 0.01)
    run = bench_report.stand_in_run(2048)
    gates = report_data.gate_summary(feats, kl, GateEstimator.kl_label(0.01), 0.8)
    data = report_data.report_data(feats, run, gates=gates, kl=kl)
    images = report_data.thumbnails(bench_report.stand_in_images(5000))
    page = report.write(data, images, tmp_path_factory.mktemp("big"))
    return page, data


@pytest.mark.slow
def test_an_imagenet100_sized_report_fits_its_budget(imagenet100_sized):
    page, data = imagenet100_sized
    assert page.stat().st_size < SIZE_BUDGET_MB * 2**20
    sizes = data["sizes"]
    assert sizes["dims_in_use"] == len(data["dims"]) and sizes["dims_in_use"] + sizes["dims_not_in_use"] == 2048
    assert sizes["dims_not_in_use"] > 0  # the dead dims are counted, not carded


@pytest.mark.slow
def test_an_imagenet100_sized_report_opens_and_scrolls(imagenet100_sized, tab):
    """It opens, renders a page of cards at a time, and more as it scrolls."""
    page, data = imagenet100_sized
    tab.open(page, "#dims")
    first = len(tab.dims())
    assert 0 < first < len(data["dims"])
    tab.page.locator("#view-dims .more").scroll_into_view_if_needed()
    tab.page.wait_for_function(f"document.querySelectorAll('#view-dims .card').length > {first}")
    tab.open(page)  # the overview: every field it reads is in the stand-in's config
    text = tab.page.inner_text("body")
    assert "(--prior bernoulli)" in text and "undefined" not in text
    assert tab.errors == []


def test_a_baseline_of_another_length_is_said_on_the_page():
    """a 225-step BayesNCL was shown beside a 20-step NCL without a word."""
    feats = bench_report.stand_in(200, 16, 4)
    run, base = bench_report.stand_in_run(16), bench_report.stand_in_run(16)
    base.update(method="ncl")
    for steps, base_steps, note in ((225, 20, True), (225, 225, False)):
        run["steps"], base["steps"] = steps, base_steps
        data = report_data.report_data(feats, run, baseline=dict(run=base, features=feats, evaluation=None))
        assert (data["baseline"]["note"] is not None) == note
    run["steps"], base["steps"] = 225, 20
    data = report_data.report_data(feats, run, baseline=dict(run=base, features=feats, evaluation=None))
    assert data["baseline"]["note"].startswith("note: the baseline (ncl) trained 20 steps and this run (bayesncl) 225")
    assert "D.baseline.note" in report.render(data, report_data.thumbnails(bench_report.stand_in_images(200)))
