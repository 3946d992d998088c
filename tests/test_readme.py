"""The README's "Use it in your own code" section: every Python snippet runs, in order, in a folder that holds
what they name (a finished run in runs/compositional-bayesncl-ste, a folder of photos); the files they define are
written where they say; every command line parses and its configuration resolves."""

import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from pyro.infer.autoguide import AutoNormal

from bayesncl_pyro import BayesNCLHead
from bayesncl_pyro.cli import run_svi
from bayesncl_pyro.train.resolve import resolve

ROOT = Path(__file__).resolve().parents[1]

TINY = ["--dataset", "compositional", "--max-steps", "2", "--epochs", "1", "--warmup-epochs", "0", "--batch-size", "64",
        "--proj-hidden", "32", "--proj-dim", "16", "--workers", "0"]


def section_blocks() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Use it in your own code\n")[1].split("\n## ")[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, re.S)


def test_the_section_has_a_snippet_for_the_head_a_backbone_a_prior_and_load_run():
    code = "\n".join(block for _, block in section_blocks())
    for needed in ("BayesNCLHead(", "--encoder timm:", "--encoder my_nets:", "--prior my_priors:", "--prior-arg",
                   "load_run("):
        assert needed in code, needed


@pytest.mark.slow  # trains the README's snippets end to end (30 s)
def test_every_snippet_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("timm", reason="the section names a timm model: pip install -e '.[timm]'")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # PYTHONPATH=. in the commands
    for name in ("my_nets", "my_priors"):  # the snippets' modules, not another test's of the same name
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert run_svi.main([*TINY, "--out", "runs/compositional-bayesncl-ste"]) == 0
    (tmp_path / "my_photos").mkdir()
    for i in range(2):
        Image.new("RGB", (50, 40), (40 * i, 90, 200)).save(tmp_path / "my_photos" / f"{i}.jpg")
    capsys.readouterr()

    namespace: dict = {}
    for language, code in section_blocks():
        first = code.splitlines()[0]
        if language == "python" and first.endswith("in a folder on PYTHONPATH"):
            (tmp_path / first.split()[1].rstrip(",")).write_text(code)  # "# my_nets.py, in a folder on PYTHONPATH"
        elif language == "python":
            exec(compile(code, "README.md", "exec"), namespace)
        else:
            assert language == "bash"
            for line in code.splitlines():
                command = shlex.split(line.removeprefix("PYTHONPATH=. "))
                assert command[:2] == ["python", "experiments/run_svi.py"], line
                cfg, _ = run_svi.config(command[2:])
                resolve(cfg)  # checks the encoder (importing a module, asking timm) and builds the prior

    assert namespace["probs"].shape == (2, 16)  # load_run's: the run's K for the two photos
    assert namespace["feats"].shape == (4, 16) and namespace["h"].shape == (4, 256)
    assert namespace["post"].draws.shape[0] == 10
    assert isinstance(namespace["head"].model.prior, torch.nn.Module)
    assert "gate_nce_pull" in capsys.readouterr().out  # the head snippet printed its pulls
    for name in ("my_nets", "my_priors"):
        sys.modules.pop(name, None)


@pytest.mark.slow  # trains a run per prior written in the README (25 s)
def test_the_priors_from_your_own_code_are_followed_as_written_and_train(tmp_path, monkeypatch, capsys):
    """A new user's path through "Priors from your own code": the module written as shown, each command of a prior of
    theirs run as shown (shortened to two steps) trains and evaluates, the correlated prior with no guide of its own
    (Pyro's AutoNormal); a registered prior's command resolves."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n### Priors from your own code\n")[1].split("\n### ")[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    (module,) = [code for language, code in blocks if language == "python"]
    assert module.startswith("# my_priors.py, in a folder on PYTHONPATH")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_priors", raising=False)
    (tmp_path / "my_priors.py").write_text(module)
    (commands,) = [code for language, code in blocks if language == "bash"]
    for i, line in enumerate(commands.splitlines()):
        command = shlex.split(line.removeprefix("PYTHONPATH=. "))
        assert command[:2] == ["python", "experiments/run_svi.py"], line
        if not line.startswith("PYTHONPATH=. "):  # a registered prior: its configuration resolves (the prior built)
            resolve(run_svi.config(command[2:])[0])
            continue
        assert run_svi.main([*command[2:], *TINY, "--out", f"runs/{i}"]) == 0, line
        assert (tmp_path / "runs" / str(i) / "eval.json").is_file()
        said = capsys.readouterr()
        assert "the KL of latent site 'g': analytic" in said.out + said.err  # the run's first lines say each KL
        if "CorrelatedLogits" in line:
            assert "the KL of latent site 'logits': Monte Carlo, one pathwise draw" in said.out + said.err

    head = BayesNCLHead(8, 16, 32, num_train=100, prior="my_priors:CorrelatedLogits", prior_args={"correlation": 0.3})
    assert isinstance(head.guide.rate_guide, AutoNormal)
    assert head.kl_kind == {"logits": "Monte Carlo, one pathwise draw", "logits_unconstrained":
                            "Monte Carlo, one pathwise draw", "g": "analytic"}
    sys.modules.pop("my_priors", None)
