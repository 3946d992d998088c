"""How long the per-dimension report takes and how large it gets at ImageNet-100's size, on a stand-in run.

    python experiments/bench_report.py                              # K = 2048, 5,000 test images, 100 classes
    python experiments/bench_report.py --dims 256 --images 1280 --classes 8 --browser

The stand-in is no trained model: it is made here, to the shapes of ImageNet-100's evaluation (K features, N test images
of C classes, 64 px thumbnails) with the structure a trained BayesNCL run has (sparse non-negative features, most
dimensions leaning towards one class, gates that close a share of them, some dimensions dead), so that the report's cost
and size can be measured without training ResNet-50. Its images are made too, to compress no better than ImageNet's
photographs at 64 px. It times each stage of the report (the numbers and the thumbnails, ``evaluate.report_data``;
the page, ``evaluate.report``) and, with ``--browser`` and Debian's Chromium, how long the page takes to open and to
render the next cards as it scrolls. Feature extraction (the backbone's forward pass over the test split) is not part
of it: it costs what evaluation costs.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bayesncl_pyro.cli import ArgumentParser
from bayesncl_pyro.data.images import TensorImages
from bayesncl_pyro.evaluate import dimensions as dm
from bayesncl_pyro.evaluate import report, report_data
from bayesncl_pyro.evaluate.heldout import TestFeatures
from bayesncl_pyro.infer.estimators import GateEstimator
from bayesncl_pyro.nn.losses import REFERENCE_KL_CLAMP

STAND_IN_RATE = 0.8  # the stand-in's prior inclusion rate (the published one)
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


def stand_in(images: int, dims: int, classes: int, seed: int = 0) -> TestFeatures:
    """Features of a stand-in run, with class-leaning dimensions and a few dead ones.

    A TestFeatures in which dimension k leans towards class k mod C (except a tenth, shared by all), is on in about 8 %
    of the images, and its gate closes it on images of other classes more often; the last 2 % of the dimensions are
    dead.
    """
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(images) % classes
    home = torch.arange(dims) % classes
    shared = torch.rand(dims, generator=g) < 0.1
    match = (labels[:, None] == home[None, :]) | shared[None, :]
    raw = torch.randn(images, dims, generator=g) - 1.4 + 2.0 * match
    raw[:, dims - dims // 50:] = -1  # dead
    ungated = F.normalize(raw.clamp_min(0), dim=1)
    logits = 1.5 * torch.randn(images, dims, generator=g) + 2.5 * match - 0.5
    probs = logits.sigmoid()
    mask = (probs > 0.5).float()
    return TestFeatures(F.normalize(ungated * mask, dim=1), labels, [f"class {c}" for c in range(classes)],
                           ungated=ungated, probs=probs, mask=mask)


def stand_in_run(dims: int) -> dict:
    """The stand-in's ``run`` entry of the report's data, its config with the fields a trained run's gives the page.

    Its gates are scored against a Bernoulli prior at :data:`STAND_IN_RATE` with the reference's KL clamp.
    """
    return dict(dir="stand-in (generated, not trained)", method="bayesncl", dataset="stand-in",
                config=dict(kl_weight=3e-5, gate="ste", encoder="stand-in", proj_dim=dims, prior="bernoulli",
                            prior_prob=STAND_IN_RATE, kl_clamp=REFERENCE_KL_CLAMP))


def stand_in_images(n: int, size: int = 64, seed: int = 0) -> TensorImages:
    """N stand-in photographs that compress about as badly as real ones.

    At ``size`` px: smooth random colour fields with texture and noise, whose thumbnails compress no better than
    ImageNet's, so the page's size is not underestimated (docs/PERFORMANCE.md, "The per-dimension report").
    """
    g = torch.Generator().manual_seed(seed)
    x = F.interpolate(torch.rand(n, 3, 4, 4, generator=g), size=size, mode="bicubic", align_corners=False)
    x = x + 0.25 * F.interpolate(torch.randn(n, 3, 16, 16, generator=g), size=size, mode="bilinear",
                                 align_corners=False)
    x = x + 0.05 * torch.randn(n, 3, size, size, generator=g)
    return TensorImages((x.clamp(0, 1) * 255).round().to(torch.uint8), [0] * n)


def open_in_browser(page: Path) -> dict:
    """Time the report page's opening and paging in headless Chromium.

    Milliseconds from navigation until the page's script has rendered its first cards (``open_ms``), and the longest of
    five pages of cards to render and paint (``page_ms``: what scrolling to the end of the list waits for), as the
    page's own clock measures them.
    """
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        browser = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                                       headless=True, viewport={"width": 1300, "height": 900})
        tab = browser.new_page()
        errors = []
        tab.on("pageerror", lambda e: errors.append(str(e)))
        tab.goto(f"{page.resolve().as_uri()}#dims")
        tab.wait_for_selector("body[data-ready='1']", timeout=300_000)
        out = dict(open_ms=tab.evaluate("performance.getEntriesByName('ready')[0].startTime"))
        out["page_ms"] = max(tab.evaluate("""() => new Promise(done => {
            const t0 = performance.now();
            lists.dims.renderMore();
            requestAnimationFrame(() => requestAnimationFrame(() => done(performance.now() - t0)));
        })""") for _ in range(5))
        browser.close()
    if errors:
        raise RuntimeError(f"the page raised: {errors[0]}")
    return out


def main(argv=None) -> int:
    """Build a stand-in run's report, print each stage's time and the page's size (and, asked, its browser times)."""
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=5000, help="test images (default: %(default)s, ImageNet-100's val)")
    p.add_argument("--dims", type=int, default=2048, help="K (default: %(default)s)")
    p.add_argument("--classes", type=int, default=100, help="default: %(default)s")
    p.add_argument("--out", type=Path, help="where the stand-in's report goes (default: a temporary folder)")
    p.add_argument("--browser", action="store_true", help="also time opening and scrolling it in headless Chromium "
                   f"({CHROMIUM}, Playwright)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    feats = stand_in(args.images, args.dims, args.classes)
    images = stand_in_images(args.images)
    kl = dm.kl_per_dim(feats.probs, torch.full((args.dims,), STAND_IN_RATE), REFERENCE_KL_CLAMP)
    run = stand_in_run(args.dims)
    times = {}

    def timed(stage, make):
        tic, cpu = time.perf_counter(), time.process_time()
        value = make()
        times[stage] = (time.perf_counter() - tic, time.process_time() - cpu)
        return value

    label = GateEstimator.kl_label(REFERENCE_KL_CLAMP)
    gates = timed("gate summary", lambda: report_data.gate_summary(feats, kl, label, STAND_IN_RATE))
    data = timed("cards, images (report.json)", lambda: report_data.report_data(feats, run, gates=gates, kl=kl))
    uris = timed("thumbnails", lambda: report_data.thumbnails(images))
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        page = timed("page and report.json written", lambda: report.write(data, uris, out))
        size = page.stat().st_size
        thumbs = sum(len(u) for u in uris)
        print(f"stand-in run: K = {args.dims}, {args.images} test images, {args.classes} classes, "
              f"{data['sizes']['dims_in_use']} dims in use; {torch.get_num_threads()} threads")
        print(f"  {'stage':<30} {'wall s':>7} {'CPU s':>7}")
        for stage, (wall, cpu) in times.items():
            print(f"  {stage:<30} {wall:7.1f} {cpu:7.1f}")
        print(f"  {'total':<30} {sum(t[0] for t in times.values()):7.1f} {sum(t[1] for t in times.values()):7.1f}")
        print(f"index.html {size / 2**20:.1f} MB: thumbnails {thumbs / 2**20:.1f} MB "
              f"({thumbs / args.images / 1024:.1f} KB an image), the rest {(size - thumbs) / 2**20:.1f} MB; "
              "report.json "
              f"{(out / 'report.json').stat().st_size / 2**20:.1f} MB")
        if args.browser:
            seen = open_in_browser(page)
            print(f"Chromium: open with its first cards after {seen['open_ms']:.0f} ms; the next page of cards "
                  f"rendered and painted in at most {seen['page_ms']:.0f} ms (of 5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
