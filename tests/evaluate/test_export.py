"""experiments/export.py: the backbone's plain state_dict loads into a fresh torchvision model by the lines it prints,
and with the head's gives load_run's features."""

import shutil
import subprocess
import sys

import torch
from helpers import TINY_RUN

from bayesncl_pyro import load_run
from bayesncl_pyro.cli import export, run_svi
from bayesncl_pyro.evaluate.weights import export_weights
from bayesncl_pyro.train.trainer import Trainer


def test_an_exported_backbone_loads_into_torchvision_and_gives_the_runs_features(tmp_path):
    run_dir = tmp_path / "run"
    cfg, _ = run_svi.config([*TINY_RUN, "--encoder", "resnet18", "--out", str(run_dir)])  # 1-channel 8 px digits
    trainer = Trainer(cfg, progress=False)  # a checkpoint is what export reads: no evaluation
    trainer.train(2)
    trainer.save()
    lines = export_weights(run_dir, tmp_path / "weights" / "backbone.pt")
    code = "\n".join(line.removeprefix("    ") for line in lines[lines.index("load them with:") + 1:])
    assert "torchvision.models.get_model('resnet18')" in code and "backbone.fc = torch.nn.Identity()" in code
    # in a fresh interpreter: nothing of the run's is in memory
    script = code + "\nbackbone.eval(); head.eval()\nx = torch.load(INPUTS)\n" + \
        "torch.save((backbone(x), head.representation(backbone(x))), OUT)\n"
    run = load_run(run_dir)
    images = torch.randint(0, 256, (5, 1, 8, 8), dtype=torch.uint8)
    torch.save(run.inputs(images), tmp_path / "x.pt")
    subprocess.run([sys.executable, "-c", f"INPUTS, OUT = {str(tmp_path / 'x.pt')!r}, {str(tmp_path / 'y.pt')!r}\n"
                    + script], check=True, cwd=tmp_path)
    h, features = torch.load(tmp_path / "y.pt")
    torch.testing.assert_close(h, run.backbone_features(images), rtol=0, atol=0)
    torch.testing.assert_close(features, run.representation(images), rtol=0, atol=0)
    # a plain state_dict: the tensors and nothing else, the head's beside it
    assert set(torch.load(tmp_path / "weights" / "backbone.pt")) == set(run.learner.backbone.state_dict())
    assert set(torch.load(tmp_path / "weights" / "backbone_head.pt")) == set(run.learner.head.state_dict())


def test_a_backbone_of_the_project_loads_through_build_backbone(tmp_path, capsys, ncl_run):
    run_dir = shutil.copytree(ncl_run, tmp_path / "run")  # the export writes into it
    assert export.main([str(run_dir)]) == 0
    printed = capsys.readouterr().out
    assert "build_backbone('cnn', 1, 8)" in printed and (run_dir / "backbone.pt").exists()
    assert export.main([str(run_dir), "--out", str(run_dir / "checkpoint.pt")]) == 2
    assert "checkpoint.pt is the name of a file that a run keeps in its folder" in capsys.readouterr().err
