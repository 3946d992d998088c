"""A gates.nc written under ArviZ 1.x (Python >= 3.12) reads under arviz 0.2x (Python 3.11), and back.

Needs a second Python whose ArviZ has the other major version, with this project installed: set
OTHER_ARVIZ_PYTHON to it (.ci/run does, after making a venv for a second interpreter). Each side writes a file
in its own interpreter, then both interpreters read both files through ``read_gates`` and ``az.summary``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
OTHER = os.environ.get("OTHER_ARVIZ_PYTHON")
pytestmark = pytest.mark.skipif(not OTHER, reason="set OTHER_ARVIZ_PYTHON to a Python with the other ArviZ "
                                                   "major version and this project installed")

# a fixed-seed beta-bernoulli learner (every group and variable present) and a two-record log
WRITE = """
import json, sys
from pathlib import Path
import torch
from bayesncl_pyro.evaluate.arviz_export import export_gates
from bayesncl_pyro.config import Config
from bayesncl_pyro.data import load_dataset
from bayesncl_pyro.infer.learner import ContrastiveLearner
from bayesncl_pyro.train.resolve import resolve
out = Path(sys.argv[1])
data = load_dataset("digits", None, seed=0)
torch.manual_seed(0)
cfg = resolve(Config(dataset="digits", proj_hidden=32, proj_dim=16, workers=0, prior="beta-bernoulli"))
learner = ContrastiveLearner(cfg, data.channels, len(data.train)).eval()
(out / "config.json").write_text(json.dumps(cfg.to_dict()))
(out / "log.jsonl").write_text('{"step": 10, "loss": 6.5, "kl": 3.0}\\n{"step": 20, "loss": 6.1, "kl": 2.5}\\n')
export_gates(out, learner, data, num_draws=3)
"""

# per file named on the command line, one JSON line: every group's numbers, and az.summary's dim_inclusion mean
READ = """
import json, sys, warnings
warnings.simplefilter("ignore", FutureWarning)
import arviz as az
from bayesncl_pyro.evaluate.arviz_export import read_gates
for path in sys.argv[1:]:
    d = read_gates(path)
    out = {"arviz": az.__version__.split(".")[0], "type": type(d).__name__, "config": d.posterior.attrs["config"]}
    for group in ("posterior", "observed_data", "gates", "training_log"):
        for name, var in {**d[group].data_vars, **d[group].coords}.items():
            out[f"{group}/{name}"] = [list(var.dims), var.values.tolist()]
    out["summary_mean"] = az.summary(d, var_names=["dim_inclusion"], kind="stats", round_to=4)["mean"].tolist()
    print(json.dumps(out))
"""


def run(python: str, script: str, *paths: Path) -> list[str]:
    done = subprocess.run([python, "-c", script, *map(str, paths)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"{python} failed:\n{done.stderr[-3000:]}"
    return done.stdout.splitlines()


def test_gates_files_read_the_same_under_both_arviz_versions(tmp_path):
    written = {python: tmp_path / name for name, python in (("this", sys.executable), ("other", OTHER))}
    for python, folder in written.items():
        folder.mkdir()
        run(python, WRITE, folder)
    # both interpreters read both files
    here, there = ([json.loads(line) for line in run(python, READ, *written.values())[-2:]]
                   for python in (sys.executable, OTHER))

    for mine, theirs in zip(here, there):
        assert {mine.pop("arviz"), theirs.pop("arviz")} == {"0", "1"}, "OTHER_ARVIZ_PYTHON has the same ArviZ"
        assert {mine.pop("type"), theirs.pop("type")} == {"DataTree", "InferenceData"}
        # the two ArviZ versions round differently (significant digits / decimals)
        np.testing.assert_allclose(mine.pop("summary_mean"), theirs.pop("summary_mean"), atol=1e-3)
        assert mine == theirs
        assert mine["posterior/g"][0] == ["chain", "draw", "item", "feature"]
        assert len(mine["posterior/g"][1][0]) == 3 and len(mine["posterior/rate"][1][0][0]) == 16
        assert mine["training_log/loss"] == [["step"], [6.5, 6.1]]
        assert mine["gates/class_label"][1][:3] == [str(label) for label in mine["observed_data/label"][1][:3]]
        assert json.loads(mine["config"])["prior"] == "beta-bernoulli"
