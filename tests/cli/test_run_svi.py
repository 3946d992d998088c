"""run_svi.py's end of a run: a failed gate export keeps the results, says why in one line, and can be redone."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import EXPERIMENTS, TINY_RUN

from bayesncl_pyro import loggers as progress
from bayesncl_pyro.cli import inspect_gates, run_svi
from bayesncl_pyro.evaluate import arviz_export


@pytest.mark.parametrize("failure, cause", [
    (OSError(28, "No space left on device"), "No space left on device"),
    (ImportError("No module named 'h5netcdf'"), "No module named 'h5netcdf'"),
])
def test_a_failed_export_keeps_the_results_and_names_the_cause_and_the_redo(tmp_path, monkeypatch, capsys, failure,
                                                                             cause):
    def fail(*args, **kwargs):
        raise failure

    run_dir = tmp_path / "run"
    args = [*TINY_RUN, "--out", str(run_dir)]
    monkeypatch.setattr(progress, "LONG", float("inf"))  # on a busy machine the probe would announce itself
    with monkeypatch.context() as m:
        m.setattr(arviz_export, "export_gates", fail)
        assert run_svi.main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and cause in err and type(failure).__name__ in err
    python, script, *redo = shlex.split(err.split("redo the export with: ")[1])
    assert Path(python).absolute() == Path(sys.executable) and redo == [str(run_dir), "--export"]
    assert Path(script).resolve() == EXPERIMENTS / "inspect_gates.py"
    assert {"eval.json", "checkpoint.pt"} <= {p.name for p in run_dir.iterdir()}
    assert not (run_dir / "gates.nc").exists()
    assert json.loads((run_dir / "eval.json").read_text())["method"] == "bayesncl"

    # the command it names writes gates.nc from the checkpoint
    assert inspect_gates.main([str(run_dir), "--export", "--out", str(tmp_path / "figures")]) == 0
    assert (run_dir / "gates.nc").exists()
    # and the run's own command, rerun, now finds nothing left to do
    assert run_svi.main(args) == 0
    assert "already holds a finished run" in capsys.readouterr().out


def test_rerunning_a_finished_run_redoes_a_missing_export(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    args = [*TINY_RUN, "--out", str(run_dir)]
    with monkeypatch.context() as m:
        m.setattr(arviz_export, "export_gates", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
        assert run_svi.main(args) == 1
    assert run_svi.main(args) == 0
    assert (run_dir / "gates.nc").exists()


def test_export_of_a_run_without_gates_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "ncl"
    assert run_svi.main([*TINY_RUN, "--method", "ncl", "--out", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "--method ncl" not in out.split("next:")[1]  # an NCL run is not told to train NCL
    assert inspect_gates.main([str(run_dir), "--export"]) == 2
    assert "has no gates to export" in capsys.readouterr().err


def test_the_training_loop_does_not_import_the_arviz_code():
    """training -> rundir; the export (arviz_export -> posterior -> rundir) belongs to the caller: no circle."""
    code = ("import sys, bayesncl_pyro.train.trainer; "
            "print(sorted(m for m in sys.modules if m.startswith('bayesncl_pyro.') or m == 'arviz'))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "arviz" not in loaded and "posterior" not in loaded and "bayesncl_pyro.rundir" in loaded


def test_a_runs_config_json_again_with_another_seed(tmp_path, monkeypatch, capsys):
    """--config FILE takes a file of Config fields, a run's own config.json as it is; the flags override it, and a
    run without --out goes to a folder named by what it is, so the changed run does not collide with the first."""
    from bayesncl_pyro.config import Config
    from bayesncl_pyro.train.resolve import resolve

    monkeypatch.chdir(tmp_path)
    assert run_svi.main(TINY_RUN) == 0
    (first,) = Path("runs").iterdir()
    assert first.name.startswith("digits-bayesncl-ste-") and f"writing to {first}/" in capsys.readouterr().out
    saved = Config.from_dict(json.loads((first / "config.json").read_text()))

    again = resolve(run_svi.config(["--config", str(first / "config.json")])[0])
    assert again == saved  # the same run: rerun, it resumes (here: is finished)
    seed1 = resolve(run_svi.config(["--config", str(first / "config.json"), "--seed", "1"])[0])
    assert saved.differences(seed1) == "seed: 0 -> 1" and seed1.out not in (saved.out, None)
    assert run_svi.main(["--config", str(first / "config.json")]) == 0
    assert "already holds a finished run" in capsys.readouterr().out


def test_a_yaml_recipe_under_the_flags(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("dataset: digits\nlr: 0.3\nprior: beta-bernoulli\nprior_args:\n  concentration: 5\n"
                      "tensorboard: true\nout: runs/mine\n")
    cfg, _ = run_svi.config(["--config", str(recipe), "--lr", "0.2", "--prior-arg", "concentration=7"])
    assert (cfg.dataset, cfg.lr, cfg.prior, cfg.prior_args, cfg.tensorboard) == (
        "digits", 0.2, "beta-bernoulli", {"concentration": "7"}, True)
    assert cfg.out == "runs/mine"  # a recipe's out is kept; only a run's own config.json's is not


def test_a_bad_config_file_is_one_line(tmp_path, capsys):
    (tmp_path / "r.json").write_text('{"epoch": 3}')
    assert run_svi.main(["--config", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'epoch'; did you mean 'epochs'?" in err


def test_the_next_commands_name_the_interpreter_and_the_pythonpath_of_user_code(monkeypatch):
    from bayesncl_pyro.config import Config

    monkeypatch.setenv("PYTHONPATH", "/my code")
    line = run_svi.command(Config(encoder="my_nets:small"), "inspect_gates.py", "runs/x")
    env, python, script, run, trust = shlex.split(line)
    assert env == "PYTHONPATH=/my code" and Path(python).absolute() == Path(sys.executable)
    assert Path(script).resolve() == EXPERIMENTS / "inspect_gates.py" and run == "runs/x"
    assert trust == "--trust-run"  # the run is the user's own: its code may be imported
    line = run_svi.command(Config(encoder="cnn"), "inspect_gates.py", "runs/x")
    assert "PYTHONPATH" not in line and "--trust-run" not in line


def test_help_lists_each_recipes_values():
    """--help said "default: dataset" with no values, and left imagefolder out."""
    text = run_svi.parser().format_help()
    assert "default: dataset)" not in text
    assert "imagefolder: 224 px, resnet18, K=256, batch 128, lars lr 0.3, 100 epochs" in text
    assert "compositional: 32 px, cnn, K=64, batch 256, sgd lr 0.06, 15 epochs" in text
    size = next(a for a in run_svi.parser()._actions if "--image-size" in a.option_strings)
    assert "imagefolder 224" in size.help and "compositional 32" in size.help


def test_the_first_line_states_the_image_size_and_optimizer(tmp_path, capsys):
    assert run_svi.main([*TINY_RUN, "--out", str(tmp_path / "run")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "at 8 px, cnn, K=" in first and ", batch 64, sgd lr " in first and "warning" not in first


def test_a_gpu_recipe_on_a_cpu_warns_with_its_cost_and_a_cpu_recipes_flags():
    from bayesncl_pyro.config import CPU_RECIPE_FLAGS, Config, with_recipe

    warning = run_svi.cpu_warning(with_recipe(Config(dataset="imagefolder")), "cpu", 6)
    assert warning.startswith("warning: imagefolder's recipe is a GPU recipe (224 px, resnet18")
    assert "its 6 steps of 128 images take about 5 min" in warning and CPU_RECIPE_FLAGS in warning
    assert "39,000 steps" in run_svi.cpu_warning(with_recipe(Config(dataset="cifar10")), "cpu", 39_000)
    assert run_svi.cpu_warning(with_recipe(Config(dataset="imagefolder")), "cuda", 6) == ""
    assert run_svi.cpu_warning(with_recipe(Config()), "cpu", 225) == ""  # the first run is a CPU recipe
    assert run_svi.cpu_warning(with_recipe(Config(dataset="cifar10", encoder="cnn")), "cpu", 100) == ""


def _commands(text: str) -> list[list[str]]:
    lines = text.split("next:\n")[1].splitlines()
    return [shlex.split(line) for line in lines if not line.startswith("      ")]


def test_the_ncl_command_of_a_run_with_a_prior_of_your_own_carries_no_prior(monkeypatch, tmp_path):
    """the NCL baseline's command carried --prior module:Class --prior-arg ..., so that the baseline
    recorded a prior it never builds and needed PYTHONPATH and --trust-run to be opened."""
    from bayesncl_pyro.config import Config, with_recipe, without_gates
    from bayesncl_pyro.rundir import code_references

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "code")
    argv = ["--dataset", "digits", "--prior", "my_priors:SteppedPrior", "--prior-arg", "scale=0.25", "--kl-weight=0.01",
            "--gate", "leg", "--epochs", "3"]
    cfg = with_recipe(Config(dataset="digits", prior="my_priors:SteppedPrior", prior_args={"scale": 0.25},
                             kl_weight=0.01, gate="leg", epochs=3, out="runs/mine"))
    train, inspect, report = _commands(run_svi.next_steps(cfg, argv))
    assert "--prior" not in train and "--prior-arg" not in train and "--gate" not in train
    assert not any(w.startswith(("--kl-weight", "PYTHONPATH")) for w in train)
    assert train[train.index("--epochs") + 1] == "3" and train[train.index("--method") + 1] == "ncl"
    assert inspect[0] == f"PYTHONPATH={tmp_path / 'code'}" and inspect[-1] == "--trust-run"  # the gated run needs both
    assert code_references(without_gates(cfg, "ncl")) == {}
    assert code_references(Config(method="ncl", prior="my_priors:SteppedPrior")) == {}  # an NCL run saved before


def test_the_next_commands_run_from_any_folder(monkeypatch, tmp_path):
    """the commands named the run folders relative to the folder the run was started in."""
    from bayesncl_pyro.config import Config, with_recipe

    monkeypatch.chdir(tmp_path)
    argv = ["--dataset", "cifar10", "--data-dir", "data/cifar", "--config=my.yaml"]
    cfg = with_recipe(Config(dataset="cifar10", data_dir=str(tmp_path / "data" / "cifar"), out="runs/mine"))
    commands = _commands(run_svi.next_steps(cfg, argv))
    paths = [w.split("=", 1)[-1] for c in commands for w in c if "/" in w or w.endswith(".yaml")]
    assert paths and all(os.path.isabs(p) for p in paths), paths
    assert str(tmp_path / "runs" / "mine") in commands[1] and str(tmp_path / "runs" / "mine-ncl") in commands[0]
    assert f"--config={tmp_path / 'my.yaml'}" in commands[0]
    assert commands[0][commands[0].index("--data-dir") + 1] == str(tmp_path / "data" / "cifar")
