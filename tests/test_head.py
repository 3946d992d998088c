"""BayesNCLHead: the loss module a user's own loop calls, and the one the Trainer trains through."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bayesncl_pyro import BayesNCLHead
from bayesncl_pyro.config import Config
from bayesncl_pyro.encoders import build_backbone
from bayesncl_pyro.losses import bernoulli_kl, info_nce_rows, normalize
from bayesncl_pyro.models.priors import BetaBernoulliPrior
from bayesncl_pyro.rundir import read_log
from bayesncl_pyro.training import Trainer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_your_backbone.py"
R, D, K, H = 12, 10, 8, 16


@pytest.mark.parametrize("prior", ["bernoulli", "learned"])
def test_head_loss_and_gradients_equal_the_trainer_step(tmp_path, prior):
    """The head built from plain arguments, on the Trainer's weights and first batch, in a plain loop (and with
    Pyro's validation on, the Trainer's fast ELBO off): the logged loss and every gradient of that step."""
    cfg = Config(out=str(tmp_path / "run"), dataset="digits", prior=prior, proj_hidden=32, proj_dim=16, batch_size=64,
                 epochs=1, warmup_epochs=0, workers=0, log_every=1)
    trainer = Trainer(cfg, progress=False)
    weights = copy.deepcopy(trainer.learner.state_dict())
    batches = []
    trainer.learner.register_forward_pre_hook(lambda module, args: batches.append(args[0].clone()))
    trainer.train(1)
    grads = {n: p.grad for n, p in trainer.learner.named_parameters() if p.grad is not None}

    backbone, width = build_backbone("cnn", in_channels=1, image_size=8)
    head = BayesNCLHead(width, proj_dim=16, proj_hidden=32, num_train=len(trainer.data.train), prior=prior,
                        prior_prob=0.8, kl_weight=3e-5, gate="ste", nonneg="rep_relu")
    for name, module in (("backbone", backbone), ("head", head)):
        module.load_state_dict({k.removeprefix(name + "."): v for k, v in weights.items() if k.startswith(name + ".")})
    loss, stats = head(backbone(batches[0]))
    loss.backward()

    logged = read_log(cfg.out)[0]
    assert loss.item() == pytest.approx(logged["loss"], abs=1e-6)
    for key in ("nce", "kl", "gate_rate", "incl_min", "incl_max", "active"):
        assert stats[key].item() == pytest.approx(logged[key], abs=1e-6, rel=1e-6), key
    assert head.pulls(stats) == pytest.approx({k: logged[k] for k in ("gate_nce_pull", "gate_prior_pull")}, rel=1e-5)
    mine = dict([*backbone.named_parameters(prefix="backbone"), *head.named_parameters(prefix="head")])
    assert mine.keys() == grads.keys()
    for name, p in mine.items():
        torch.testing.assert_close(p.grad, grads[name], rtol=0, atol=1e-6, msg=name)


def test_head_stats_are_its_return_values_and_match_the_formula():
    """The loss is InfoNCE + lambda * KL per row of the gated rows; each call's values come back with it (two
    calls, two sets), and the gate pulls appear once backward has run."""
    torch.manual_seed(0)
    head = BayesNCLHead(D, K, H, num_train=500, kl_weight=0.05, prior_prob=0.7)
    h1, h2 = torch.randn(R, D), torch.randn(R, D)
    (loss1, s1), (loss2, s2) = head(h1), head(h2)
    assert head.pulls(s1) == {}
    alpha = head.gate_probs(h1)
    u = normalize(head.model.features(head.projector(h1)) * (alpha > 0.5).float())
    nce, kl = info_nce_rows(u, 0.2).mean(), bernoulli_kl(alpha, 0.7, 0.01).sum(1).mean()
    torch.testing.assert_close(loss1, nce + 0.05 * kl)
    torch.testing.assert_close(s1["nce"], nce.detach())
    torch.testing.assert_close(s1["kl"], kl.detach(), rtol=1e-4, atol=1e-4)  # (loss - nce) / lambda in float32
    torch.testing.assert_close(s1["probs"], alpha.detach())
    torch.testing.assert_close(s1["gate_rate"], alpha.mean().detach())
    assert s1["features"].shape == s1["gates"].shape == (R, K) and not s1["nce"].requires_grad
    assert s2["nce"] != s1["nce"]
    loss1.backward()
    assert set(head.pulls(s1)) == {"gate_nce_pull", "gate_prior_pull"}


@pytest.mark.parametrize("nonneg", ["rep_relu", "none"])
def test_without_a_prior_the_head_is_ncl_or_simclr(nonneg):
    head = BayesNCLHead(D, K, H, num_train=500, prior=None, nonneg=nonneg)
    h = torch.randn(R, D)
    loss, stats = head(h)
    z = head.projector(h)
    u = normalize(F.relu(z) if nonneg == "rep_relu" else z)
    torch.testing.assert_close(loss, info_nce_rows(u, 0.2).mean())
    assert set(stats) == {"nce", "kl", "active", "features"} and stats["kl"] == 0
    assert head.param_groups(0.1)[0]["params"] == list(head.projector.parameters()) and len(head.param_groups(0.1)) == 1
    assert ((head.representation(h) < 0).any()) == (nonneg == "none")


def test_head_takes_a_prior_object_and_names_bad_arguments():
    prior = BetaBernoulliPrior(K, 0.6, concentration=4.0)
    head = BayesNCLHead(D, K, H, num_train=500, prior=prior, kl_weight=0.01)
    assert head.model.prior is prior and head.guide.rate_guide is not None
    groups = {g["name"]: g for g in head.param_groups(0.3, gate_lr=0.1, backbone=torch.nn.Linear(3, D))}
    assert groups["prior"]["lr"] == pytest.approx(0.1 / 0.01) and len(groups["encoder"]["params"]) == 2 + 4
    with pytest.raises(Exception, match="the prior has 8 gates but the head 4 features"):
        BayesNCLHead(D, 4, H, num_train=500, prior=prior)
    with pytest.raises(Exception, match="unknown gate 'hard'"):
        BayesNCLHead(D, K, H, num_train=500, gate="hard")
    with pytest.raises(Exception, match="takes no argument 'conc'; it takes concentration"):
        BayesNCLHead(D, K, H, num_train=500, prior="beta-bernoulli", prior_args={"conc": 5})


def test_the_example_trains_a_torchvision_backbone_in_a_plain_loop():
    assert len(EXAMPLE.read_text().splitlines()) <= 60
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "2", "--batch-size", "8"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "step 2: loss" in proc.stdout and "of the gates open" in proc.stdout


def test_two_heads_in_one_process_keep_their_own_prior_parameters():
    """A learned prior's rate is the head's own parameter, not an entry of Pyro's global param store that the
    next head (the next run of compare.py) would pick up, leaving its optimizer a parameter nobody uses."""
    first = BayesNCLHead(D, K, H, num_train=500, prior="learned", kl_weight=0.5)
    optimizer = torch.optim.SGD(first.param_groups(0.1, gate_lr=1.0), lr=0.1)
    first(torch.randn(R, D))[0].backward()
    optimizer.step()
    moved = first.model.prior.rate().detach()
    assert not torch.allclose(moved, torch.full((K,), 0.8))
    second = BayesNCLHead(D, K, H, num_train=500, prior="learned", kl_weight=0.5)
    second(torch.randn(R, D))[0].backward()
    torch.testing.assert_close(second.model.prior.rate().detach(), torch.full((K,), 0.8))
    assert second.model.prior.logit_rate_unconstrained.grad is not None  # the parameter its optimizer holds
    torch.testing.assert_close(first.model.prior.rate().detach(), moved)


def test_importing_the_package_stays_light():
    """`import bayesncl_pyro` loads neither torch nor Pyro; the head and load_run load on first use."""
    code = ("import sys, bayesncl_pyro; light = 'torch' not in sys.modules; "
            "from bayesncl_pyro import BayesNCLHead, load_run; print(light, 'pyro' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True"]
