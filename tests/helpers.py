"""What several test files share: the tiny run's flags, the scripts run as users run them, small image trees, and
checks of exact resumption. Test files import from here, never from each other."""

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bayesncl_pyro.config import Config
from bayesncl_pyro.data.photos import photo

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
RUN_SVI = EXPERIMENTS / "run_svi.py"

# two steps of BayesNCL on digits (run_svi.py's flags): seconds, with every file a run writes
TINY_RUN = ["--dataset", "digits", "--max-steps", "2", "--epochs", "1", "--warmup-epochs", "0", "--batch-size", "64",
            "--proj-hidden", "32", "--proj-dim", "16", "--workers", "0", "--log-every", "1"]
TINY_COMPARE = ["--dataset", "digits", "--max-steps", "2", "--epochs", "1", "--warmup-epochs", "0",
                "--batch-size", "64", "--proj-hidden", "32", "--proj-dim", "16", "--workers", "0"]


# Trainer configs of a tiny digits run: 44 steps per epoch at batch 32; runs stop early through max_steps (which may
# change on resume)
FAST = dict(dataset="digits", proj_hidden=32, proj_dim=16, batch_size=32, epochs=2, warmup_epochs=0.5,
            workers=0, log_every=1, ckpt_every=2)


def fast(path: Path, **kw) -> Config:
    return Config(out=str(path), **{**FAST, **kw})


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    """experiments/<script> as a user runs it: a process of its own."""
    return subprocess.run([sys.executable, str(EXPERIMENTS / script), *args], capture_output=True, text=True,
                          timeout=600)


# -- image trees -------------------------------------------------------------------------------------------------


def write_image(path: Path, mode: str = "RGB", size=(12, 10), fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    color = {"L": 128, "RGBA": (10, 20, 30, 40), "CMYK": (10, 20, 30, 40)}.get(mode, (200, 100, 50))
    Image.new(mode, size, color).save(path, format=fmt)
    return path


def make_tree(root: Path, splits: dict[str, list[str]], ext: str = ".png") -> Path:
    """``root/<split>/<class>/0<ext>`` with one small image per class."""
    for split, classes in splits.items():
        for c in classes:
            write_image(root / split / c / f"0{ext}")
    return root


def write_photo(path, size=(50, 40), seed=0, mode="RGB", fmt=None):
    """``data.photos.photo`` (like a photo, unlike write_image's flat colour), ``size`` = (w, h), in ``mode``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    photo(seed, size).convert(mode).save(path, format=fmt, quality=90)
    return path


def photo_tree(root, per_class=6):
    """train/{a,b}/ with colour JPEGs of several sizes, plus a PNG, a grayscale and a CMYK JPEG; val/{a,b}/."""
    for c, name in enumerate("ab"):
        for i in range(per_class):
            write_photo(root / "train" / name / f"{i}.jpg", size=(40 + 7 * i, 60 - 3 * i), seed=10 * c + i)
        write_photo(root / "val" / name / "0.jpg", seed=99 + c)
    write_photo(root / "train" / "a" / "png.png")
    write_photo(root / "train" / "b" / "gray.jpg", mode="L")
    write_photo(root / "train" / "b" / "cmyk.jpg", mode="CMYK", fmt="JPEG")
    return root


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) * 2 // 3])  # the header survives: the worker passes it on as a JPEG
    return path


# -- exact resumption --------------------------------------------------------------------------------------------


def assert_resume_is_exact(straight, config):
    """Train ``straight`` (a Trainer) 6 steps, and ``config(**overrides)``'s run 4 steps (mid-epoch 2), saved and
    resumed to 6: the weights must be equal."""
    from bayesncl_pyro.train.trainer import Trainer

    straight.train(6)
    first = Trainer(config(max_steps=4), progress=False)
    first.train(4)
    first.save()
    resumed = Trainer(config(), progress=False)
    resumed.train(6)
    for k, v in straight.learner.state_dict().items():
        torch.testing.assert_close(resumed.learner.state_dict()[k], v, rtol=0, atol=0, msg=k)


def assert_same_params(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def cli(cfg: Config) -> list[str]:
    """run_svi.py flags for the non-default fields of ``cfg``."""
    default = Config()
    return [a for k, v in cfg.to_dict().items() if v != getattr(default, k)
            for a in (f"--{k.replace('_', '-')}", str(v))]


def log_lines(cfg: Config) -> list[str]:
    log = Path(cfg.out) / "log.jsonl"
    return log.read_text().splitlines() if log.exists() else []


def logged_step(cfg: Config, since: int = 0) -> int:
    """The last step in the log after its first ``since`` lines (a line being written is not yet one)."""
    return max((json.loads(line)["step"] for line in log_lines(cfg)[since:] if line.endswith("}")), default=0)


# -- the report in a browser -------------------------------------------------------------------------------------


class Tab:
    """One headless Chromium tab (no network), collecting console errors and non-file requests. The page keeps
    nothing in the browser's storage, so the tabs of one module share a browser and its profile."""

    def __init__(self, browser):
        self.page = browser.new_page()
        self.errors, self.requests = [], []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))

    def open(self, path: Path, view: str = ""):
        self.page.goto(path.resolve().as_uri() + view)
        self.page.wait_for_selector("body[data-ready='1']")

    def follow(self, selector: str):
        """Click a link and wait until the page has shown its view: the click returns before the hashchange event
        is handled, so a view read straight after it may still be the old one."""
        self.page.click(selector)
        self.page.wait_for_function("document.body.dataset.routed === location.hash")

    def dims(self, view="#view-dims") -> list[int]:
        return [int(d) for d in self.page.eval_on_selector_all(f"{view} .card", "cs => cs.map(c => c.dataset.dim)")]

    def scroll_all(self, view="#view-dims") -> list[int]:
        """Scroll until every matching card is rendered (they come a page at a time)."""
        want = int(self.page.get_attribute(f"{view} .cards", "data-matching"))
        while len(self.dims(view)) < want:
            before = len(self.dims(view))
            self.page.locator(f"{view} .more").scroll_into_view_if_needed()
            self.page.wait_for_function(f"document.querySelectorAll('{view} .card').length > {before}")
        return self.dims(view)

    def close(self):
        self.page.close()


def docs_extension():
    """The documentation site's extension (docs/_ext/bayesncl_docs.py): what the site generates, and from where."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bayesncl_docs", ROOT / "docs" / "_ext" / "bayesncl_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_cifar_pickles(root: Path, name: str, rows: int = 4) -> Path:
    """A few rows of the official python-version CIFAR files (Python 2 style byte-string keys)."""
    rng = np.random.default_rng(0)

    def dump(path, obj):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(obj))

    def batch(label_key, num_classes):
        return {b"data": rng.integers(0, 256, (rows, 3072), dtype=np.uint8),
                label_key: [int(y) for y in rng.integers(0, num_classes, rows)]}

    if name == "cifar10":
        folder = root / "cifar-10-batches-py"
        for f in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            dump(folder / f, batch(b"labels", 10))
        dump(folder / "batches.meta", {b"label_names": [f"c{i}".encode() for i in range(10)]})
    else:
        folder = root / "cifar-100-python"
        for f in ("train", "test"):
            dump(folder / f, {**batch(b"fine_labels", 100), b"coarse_labels": [0] * rows})
        dump(folder / "meta", {b"fine_label_names": [f"f{i}".encode() for i in range(100)]})
    return folder


def one_error_line(err: str) -> str:
    """The one ``error: ...`` line a command printed on stderr, with no traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]
