"""Every script in experiments/ runs as a subprocess with tiny arguments; a script missing here fails."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
TINY_RUN = ["--max-steps", "2", "--epochs", "1", "--warmup-epochs", "0", "--batch-size", "64",
            "--proj-hidden", "32", "--proj-dim", "16", "--workers", "0", "--log-every", "1"]



def tiny_run(tmp, *args: str) -> str:
    """A finished two-step run folder (for scripts that read one)."""
    out = str(tmp / "_".join(["run", *args]).replace("-", ""))
    proc = run("run_svi.py", *TINY_RUN, "--conflict-every", "1", "--out", out, *args)
    assert proc.returncode == 0, proc.stderr
    return out


SCRIPTS = {
    "run_svi.py": lambda tmp: TINY_RUN + ["--out", str(tmp / "run")],
    "inspect_gates.py": lambda tmp: [tiny_run(tmp), "--out", str(tmp / "figures")],
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
    assert {"config.json", "checkpoint.pt", "log.jsonl", "eval.json", "gates.nc"} <= {p.name for p in run_dir.iterdir()}
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


def test_inspect_gates_draws_every_figure_and_compares_with_a_baseline(tmp_path):
    bayes, ncl = tiny_run(tmp_path), tiny_run(tmp_path, "--method", "ncl")
    proc = run("inspect_gates.py", bayes, "--baseline", ncl)
    assert proc.returncode == 0, proc.stderr
    figures = {p.name for p in (Path(bayes) / "inspect").iterdir()}
    assert figures == {"elbo.png", "kl_per_dim.png", "inclusion.png", "class_heatmap.png", "top_images.png",
                       "conflict.png", "summary.txt"}
    assert "conflict (bayesncl)" in proc.stdout and "conflict (ncl)" in proc.stdout
    proc = run("inspect_gates.py", ncl)  # a run without gates gets the figures that need none
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in (Path(ncl) / "inspect").iterdir()} == {"elbo.png", "top_images.png", "conflict.png",
                                                                     "summary.txt"}
    proc = run("inspect_gates.py", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "no checkpoint.pt" in proc.stderr
