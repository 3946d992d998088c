"""The names users call import from the top level, the old paths of moved names still work with a
DeprecationWarning naming the new one, and a user can silence the library's messages as in a notebook."""

import importlib
import logging
import subprocess
import sys
import warnings

import pytest
import torch

import bayesncl_pyro
from bayesncl_pyro import _deprecated, rundir
from bayesncl_pyro.evaluate import arviz_export, novelty_scores, posterior, run
from bayesncl_pyro.evaluate.loading import load_learner
from bayesncl_pyro.infer.estimators import GateEstimator
from bayesncl_pyro.infer.head import HeadOutput
from bayesncl_pyro.models import priors


def test_the_top_level_names_are_the_objects_of_their_modules():
    from bayesncl_pyro.config import Config
    from bayesncl_pyro.infer.head import BayesNCLHead
    from bayesncl_pyro.train.trainer import Trainer

    expected = {"BayesNCLHead": BayesNCLHead, "Config": Config, "Trainer": Trainer, "load_run": run.load_run,
                "gate_posterior": posterior.gate_posterior, "export_gates": arviz_export.export_gates,
                "read_gates": arviz_export.read_gates, "Prior": priors.Prior, "PRIORS": priors.PRIORS,
                "register": priors.register}
    assert sorted(bayesncl_pyro.__all__) == sorted(expected)
    assert set(expected) <= set(dir(bayesncl_pyro))
    for name, obj in expected.items():
        assert getattr(bayesncl_pyro, name) is obj, name
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        bayesncl_pyro.nothing  # noqa: B018


def test_importing_the_package_loads_neither_torch_nor_pyro():
    code = "import sys, bayesncl_pyro; bayesncl_pyro.__all__; print(sorted({'torch', 'pyro'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


@pytest.mark.parametrize("module, name, new", [
    ("bayesncl_pyro.infer.learner", "load_learner", load_learner),
    ("bayesncl_pyro.posterior", "gate_posterior", posterior.gate_posterior),
    ("bayesncl_pyro.posterior", "GatePosterior", posterior.GatePosterior),
    ("bayesncl_pyro.evaluate.dimensions", "kl_label", GateEstimator.kl_label),
    ("bayesncl_pyro.evaluate.dimensions", "gate_posterior", posterior.gate_posterior),
    ("bayesncl_pyro.evaluate.novelty", "NoveltyScorer", novelty_scores.NoveltyScorer)])
def test_a_moved_name_works_from_its_old_path_with_a_warning_naming_the_new_one(module, name, new):
    target = _deprecated.MOVED[module][name].replace(":", ".")
    with pytest.warns(DeprecationWarning, match=f"{module}.{name} moved to {target}; import it from there") as seen:
        old = getattr(importlib.import_module(module), name)
    assert old == new and seen[0].filename == __file__  # the warning points at the caller's line
    with pytest.warns(DeprecationWarning, match=target):
        exec(f"from {module} import {name}", {})
    with pytest.raises(AttributeError, match=f"module '{module}' has no attribute 'nothing'"):
        importlib.import_module(module).nothing  # noqa: B018


def test_every_moved_name_resolves():
    for module, names in _deprecated.MOVED.items():
        for name in names:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                assert getattr(importlib.import_module(module), name) is not None


def test_a_notebook_user_silences_the_library_messages(tmp_path, capsys, caplog):
    """The library's notes go through logging (logger ``bayesncl_pyro``): shown by default as Python shows
    warnings, gone once the user raises the logger's level, as a notebook cell would."""
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1}\n{"step": 2, "lo')
    rundir.read_log(tmp_path)
    assert [r.name for r in caplog.records] == ["bayesncl_pyro.rundir"] and caplog.records[0].levelno == logging.WARNING
    caplog.clear()
    logging.getLogger("bayesncl_pyro").setLevel(logging.ERROR)
    try:
        rundir.read_log(tmp_path)
    finally:
        logging.getLogger("bayesncl_pyro").setLevel(logging.NOTSET)
    assert caplog.records == [] and capsys.readouterr().err == ""


def test_without_any_logging_setup_a_note_reaches_stderr_as_its_own_text(tmp_path):
    """What a plain Python session (no handler configured) shows: the note's text, one line on stderr."""
    (tmp_path / "log.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')
    code = f"from bayesncl_pyro import rundir; rundir.read_log({str(tmp_path)!r})"
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr
    assert err.startswith(f"note: {tmp_path / 'log.jsonl'}: 1 line(s) are not records") and err.count("\n") == 1
    silenced = f"import logging; logging.getLogger('bayesncl_pyro').setLevel(logging.ERROR); {code}"
    assert subprocess.run([sys.executable, "-c", silenced], capture_output=True, text=True, check=True).stderr == ""


def test_the_renamed_posterior_fields_read_as_before_with_a_warning():
    """``GatePosterior``'s beta-bernoulli fields, renamed when global latents came to be read by site name."""
    a, b, rate = torch.rand(4) + 1, torch.rand(4) + 1, torch.rand(3, 4)
    post = posterior.GatePosterior(torch.rand(2, 4), torch.rand(2, 4), torch.zeros(2), ["x"], global_draws={
        "rate": rate}, global_params={"a": a, "b": b}, global_convergence=(12.0, 480.0))
    with pytest.warns(DeprecationWarning, match=r'rate_draws is now GatePosterior.global_draws\["rate"\]'):
        assert post.rate_draws is rate
    with pytest.warns(DeprecationWarning, match="rate_beta"):
        assert post.rate_beta == (a, b)
    with pytest.warns(DeprecationWarning, match="rate_optimum_concentration"):
        assert post.rate_optimum_concentration == 480.0
    plain = posterior.GatePosterior(torch.rand(2, 4), torch.rand(2, 4), torch.zeros(2), ["x"])
    with pytest.warns(DeprecationWarning):
        assert plain.rate_draws is None and plain.rate_beta is None and plain.rate_optimum_concentration is None


def test_the_heads_output_read_as_a_dict_warns_naming_the_attribute_and_the_release_it_goes_in():
    """``out["nce"]``, the head's output before it was a HeadOutput, still reads, with the same warning's form."""
    out = HeadOutput(nce=torch.tensor(1.5), kl=torch.tensor(0.0), features=torch.zeros(2, 3))
    with pytest.warns(DeprecationWarning, match=r"out\['nce'\] is now out.nce .*goes in bayesncl-pyro 0.5.0") as seen:
        assert out["nce"] is out.nce
    assert seen[0].filename == __file__  # the warning points at the caller's line
