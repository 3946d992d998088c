"""Every script in experiments/ runs as a subprocess with tiny arguments; a script missing here fails."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
TINY_RUN = ["--max-steps", "2", "--epochs", "1", "--warmup-epochs", "0", "--batch-size", "64",
            "--proj-hidden", "32", "--proj-dim", "16", "--workers", "0", "--log-every", "1"]

SCRIPTS = {
    "run_svi.py": lambda tmp: TINY_RUN + ["--out", str(tmp / "run")],
    "bench_step.py": lambda tmp: ["--steps", "1", "--repeats", "1", "--warmup", "0", "--batch-size", "32",
                                  "--proj-hidden", "32", "--proj-dim", "16", "--pipeline-batches", "1",
                                  "--workers", "0"],
}


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXPERIMENTS / script), *args], capture_output=True, text=True,
                          timeout=600)


def test_every_script_is_smoke_tested():
    assert sorted(p.name for p in EXPERIMENTS.glob("*.py")) == sorted(SCRIPTS)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_runs(script, tmp_path):
    proc = run(script, *SCRIPTS[script](tmp_path))
    assert proc.returncode == 0, proc.stderr


def test_run_svi_writes_its_files_and_prints_the_table(tmp_path):
    proc = run("run_svi.py", *TINY_RUN, "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert "semantic_consistency" in proc.stdout and "linear_probe_top1" in proc.stdout
    run_dir = tmp_path / "run"
    assert {"config.json", "checkpoint.pt", "log.jsonl", "eval.json"} <= {p.name for p in run_dir.iterdir()}
    assert json.loads((run_dir / "config.json").read_text())["method"] == "bayesncl"


@pytest.mark.parametrize("args, message", [
    (["--dataset", "in100", "--data-dir", "/nonexistent/imagenet"], "/nonexistent/imagenet"),
    (["--dataset", "in100"], "--data-dir"),
    (["--prior", "nope"], "choose one of"),
    (["--temperature", "-1"], "temperature must be positive"),
])
def test_user_errors_are_one_line_without_traceback(tmp_path, args, message):
    proc = run("run_svi.py", *args, "--out", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0


def test_run_svi_trains_on_an_imagenet_tree(tmp_path):
    """The in100 path end to end, on a generated full-ImageNet tree (100 listed classes + extras)."""
    from test_data import make_tree

    from bayesncl_pyro.data import imagenet100_classes

    classes = imagenet100_classes() + ["n00000001"]
    make_tree(tmp_path / "imagenet", {"train": classes, "val": classes}, ext=".JPEG")
    proc = run("run_svi.py", "--dataset", "in100", "--data-dir", str(tmp_path / "imagenet"), "--encoder", "cnn",
               "--image-size", "32", *TINY_RUN, "--batch-size", "50", "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["dataset"] == "in100"
