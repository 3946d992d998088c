import gc
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pyro
import pytest
import torch


@pytest.fixture(autouse=True)
def _pyro_state():
    """Every test starts with an empty param store, validation on and a fixed seed."""
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    with pyro.validation_enabled(True):
        yield
    pyro.clear_param_store()


def pytest_configure(config):
    torch.set_num_threads(2)


from fake_cuda import fake_cuda  # noqa: E402,F401 -- the fixture: a CPU stand-in for CUDA (tests/fake_cuda.py)


def _tiny_run(tmp_path_factory, name: str, *args: str):
    from helpers import TINY_RUN

    from bayesncl_pyro.cli import run_svi

    out = tmp_path_factory.mktemp("tiny") / name
    assert run_svi.main([*TINY_RUN, "--conflict-every", "1", "--out", str(out), *args]) == 0
    return out


# Trained once per session for every test that reads a finished run (report, load_run, export, inspect_gates, the
# scripts): tests only read them, and write under folders of their own (a test that writes into a run copies it).
@pytest.fixture(scope="session")
def bayes_run(tmp_path_factory):
    """A finished two-step BayesNCL run on digits (helpers.TINY_RUN, a conflict record every step), with gates.nc."""
    return _tiny_run(tmp_path_factory, "bayesncl")


@pytest.fixture(scope="session")
def ncl_run(tmp_path_factory):
    """The same as NCL: a run without gates."""
    return _tiny_run(tmp_path_factory, "ncl", "--method", "ncl")


@pytest.fixture(scope="session")
def executed_notebook(tmp_path_factory):
    """A notebook run top to bottom in its folder, once a session for every test that reads it (the notebook tests
    and the documentation site's): ``run(path)`` gives the executed notebook, the text its code cells printed and
    the folder above its runs/ (its checkout's stand-in)."""
    import nbformat
    from nbclient import NotebookClient

    done = {}

    def run(path: Path):
        if path not in done:
            tmp = tmp_path_factory.mktemp(path.stem)
            nb = nbformat.read(path, as_version=4)
            # a notebook trains into runs/ of the checkout it sits in (the folder above notebooks/): run from
            # tmp/notebooks/, its runs land in tmp/runs/, the installed package being the one tested
            (tmp / "notebooks").mkdir()
            NotebookClient(nb, timeout=600, kernel_name="python3",
                           resources={"metadata": {"path": str(tmp / "notebooks")}}).execute()
            text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
            done[path] = nb, text, tmp
        return done[path]

    return run


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Debian Chromium with a fresh profile, launched once a module (seconds each time), or a skip that says
    why there is none (a failure under REQUIRE_CHROMIUM=1, which .ci/run sets where it installed Chromium: there the
    browser tests must run); each test opens a tab."""
    from bayesncl_pyro.cli import bench_report

    no_browser = pytest.fail if os.environ.get("REQUIRE_CHROMIUM") == "1" else pytest.skip
    try:
        from playwright import sync_api
    except ImportError:
        no_browser("Playwright for Python is not installed (pip install -e '.[test]')")
    if not Path(bench_report.CHROMIUM).exists():
        no_browser(f"no Chromium at {bench_report.CHROMIUM}: install Debian's package (apt-get install -y chromium), "
                   "as .ci/run does, to test the page in a browser")
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            tmp_path_factory.mktemp("chromium"), executable_path=bench_report.CHROMIUM, args=bench_report.CHROMIUM_ARGS,
            headless=True, viewport={"width": 1300, "height": 900})
        yield context
        context.close()


@pytest.fixture
def tab(browser):
    """A tab of the module's Chromium (helpers.Tab), closed after the test."""
    from helpers import Tab

    t = Tab(browser)
    yield t
    t.close()


# the run folder tests' resumable run (test_run_folder_files.py, test_run_folder_second_layer.py)
@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """A digits run stopped at step 2 of 4, with a checkpoint: a rerun resumes it."""
    from helpers import fast  # here, as the other fixtures' imports: the trainer's import is no session's start-up cost

    from bayesncl_pyro.train.trainer import Trainer

    out = tmp_path_factory.mktemp("stopped") / "run"
    trainer = Trainer(fast(out, max_steps=4, conflict_every=1), progress=False)
    trainer.train(2)
    trainer.save()
    del trainer  # its lock goes with it
    gc.collect()
    return out


@pytest.fixture
def unfinished(stopped, tmp_path) -> Path:
    """A copy of the stopped run, for a test to resume."""
    return shutil.copytree(stopped, tmp_path / "run")


# the run folder tests' code named by a run's config (test_run_folder_safety.py, test_run_folder_second_layer.py)
@pytest.fixture
def gadget_module(tmp_path, monkeypatch) -> Path:
    """A module ``run_gadget`` on sys.path that writes ``imported`` when imported; ``small`` builds a small CNN, the
    trained run's backbone, so a trusted load gets its weights."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "run_gadget.py").write_text(textwrap.dedent(f'''
        from pathlib import Path
        Path({str(tmp_path / "imported")!r}).touch()
        from bayesncl_pyro.nn.encoders import SmallCNN

        def small(in_channels):
            return SmallCNN(in_channels)
    '''))
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.delitem(sys.modules, "run_gadget", raising=False)
    return tmp_path / "imported"


@pytest.fixture(scope="session")
def compared(tmp_path_factory) -> tuple[list[str], Path]:
    """A one-run comparison (NCL, two steps) whose run is kept in a --record folder: a rerun trains nothing."""
    from helpers import TINY_COMPARE

    from bayesncl_pyro.cli import compare

    root = tmp_path_factory.mktemp("compared")
    args = [*TINY_COMPARE, "--methods", "ncl", "--device", "cpu", "--out", str(root / "out"), "--record",
            str(root / "record")]
    assert compare.main(args) == 0
    return args, root


@pytest.fixture
def holder(tmp_path):
    """Start a process that holds the lock of a run folder, as a training run does, until the test ends."""
    started = []

    def hold(run: Path) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-c", "import sys; from pathlib import Path; from bayesncl_pyro import rundir; "
             f"lock = rundir.lock(Path({str(run)!r})); print('locked', flush=True); sys.stdin.read()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        started.append(process)
        assert process.stdout.readline() == "locked\n"
        return process

    yield hold
    for process in started:
        process.communicate("")
