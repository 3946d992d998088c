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
    from bayesncl_pyro.cli import run_svi
    from helpers import TINY_RUN

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
