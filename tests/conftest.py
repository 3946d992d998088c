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
