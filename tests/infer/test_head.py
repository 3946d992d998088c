"""BayesNCLHead: the loss module a user's own loop calls, and the one the Trainer trains through."""

import copy
import math
import runpy
import subprocess
import sys
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F

from bayesncl_pyro import BayesNCLHead
from bayesncl_pyro.config import Config
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.infer.head import HeadOutput, gate_pulls
from bayesncl_pyro.models.priors import BetaBernoulliPrior
from bayesncl_pyro.nn.encoders import build_backbone
from bayesncl_pyro.nn.losses import bernoulli_kl, info_nce_rows, normalize
from bayesncl_pyro.rundir import read_log
from bayesncl_pyro.train.resolve import resolve
from bayesncl_pyro.train.trainer import Trainer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_your_backbone.py"
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
        assert getattr(stats, key).item() == pytest.approx(logged[key], abs=1e-6, rel=1e-6), key
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
    (loss1, s1), (_, s2) = head(h1), head(h2)
    assert head.pulls(s1) == {}
    alpha = head.gate_probs(h1)
    u = normalize(head.model.features(head.projector(h1)) * (alpha > 0.5).float())
    nce, kl = info_nce_rows(u, 0.2).mean(), bernoulli_kl(alpha, 0.7, 0.01).sum(1).mean()
    torch.testing.assert_close(loss1, nce + 0.05 * kl)
    torch.testing.assert_close(s1.nce, nce.detach())
    torch.testing.assert_close(s1.kl, kl.detach(), rtol=1e-4, atol=1e-4)  # (loss - nce) / lambda in float32
    torch.testing.assert_close(s1.probs, alpha.detach())
    torch.testing.assert_close(s1.gate_rate, alpha.mean().detach())
    assert s1.features.shape == s1.gates.shape == (R, K) and not s1.nce.requires_grad
    assert s2.nce != s1.nce
    loss1.backward()
    assert set(head.pulls(s1)) == {"gate_nce_pull", "gate_prior_pull"}


@pytest.mark.parametrize("gate", ["ste", "leg", "gs-reference-kl"])
def test_the_monitoring_values_change_no_bit_of_the_loss_and_are_computed_from_their_own_step(gate):
    """The head's loss and every gradient are the ELBO's alone, bit for bit; the summary figures, computed when read,
    are those of the step that returned them even when read after the next step has run."""
    torch.manual_seed(0)
    head = BayesNCLHead(D, K, H, num_train=500, gate=gate, kl_weight=0.05)
    h = torch.randn(R, D)
    pyro.set_rng_seed(1)
    loss, stats = head(h)
    loss.backward()
    grads = [p.grad.clone() for p in head.parameters()]
    head.zero_grad()
    pyro.set_rng_seed(1)
    alone = head.elbo_terms(head.projector(h), h).loss
    alone.backward()
    assert torch.equal(loss, alone)
    assert all(torch.equal(p.grad, g) for p, g in zip(head.parameters(), grads, strict=True))

    assert isinstance(stats, HeadOutput) and stats.kl_weight == 0.05 and stats.estimator is head.estimator
    assert stats.q.probs.shape == stats.gates.shape == (R, K) and stats.prior_rate.shape == (K,)
    head(torch.randn(R, D))  # the next step, before the figures are read
    u, probs = stats.features, stats.probs
    mask = (stats.kl_probs > 0.5) if gate == "gs-reference-kl" else (probs > 0.5)
    assert torch.equal(stats.active, (u.abs() > 1e-5).float().mean())
    assert torch.equal(stats.gate_rate, probs.mean())
    assert torch.equal(stats.incl_min, probs.mean(0).min()) and torch.equal(stats.incl_max, probs.mean(0).max())
    assert torch.equal(stats.gates_open, mask.float().mean())


@pytest.mark.parametrize("nonneg", ["rep_relu", "none"])
def test_without_a_prior_the_head_is_ncl_or_simclr(nonneg):
    head = BayesNCLHead(D, K, H, num_train=500, prior=None, nonneg=nonneg)
    h = torch.randn(R, D)
    loss, stats = head(h)
    z = head.projector(h)
    u = normalize(F.relu(z) if nonneg == "rep_relu" else z)
    torch.testing.assert_close(loss, info_nce_rows(u, 0.2).mean())
    assert stats.kl == 0 and stats.gates is None and stats.q is None and stats.kl_weight is None
    assert head.param_groups(0.1)[0]["params"] == list(head.projector.parameters()) and len(head.param_groups(0.1)) == 1
    assert ((head.representation(h) < 0).any()) == (nonneg == "none")


def test_head_takes_a_prior_object_and_names_bad_arguments():
    prior = BetaBernoulliPrior(K, 0.6, concentration=4.0)
    head = BayesNCLHead(D, K, H, num_train=500, prior=prior, kl_weight=0.01)
    assert head.model.prior is prior and head.guide.rate_guide is not None
    groups = {g["name"]: g for g in head.param_groups(0.3, gate_lr=0.1, backbone=torch.nn.Linear(3, D))}
    # the prior's step is the gating head's lr on gradients divided by lambda (was: lr gate_lr / lambda)
    assert groups["prior"]["lr"] == 0.1 and groups["prior"]["grad_scale"] == pytest.approx(1 / 0.01)
    assert len(groups["encoder"]["params"]) == 2 + 4
    with pytest.raises(Exception, match="the prior has 8 gates but the head 4 features"):
        BayesNCLHead(D, 4, H, num_train=500, prior=prior)
    with pytest.raises(Exception, match="unknown gate 'hard'"):
        BayesNCLHead(D, K, H, num_train=500, gate="hard")
    with pytest.raises(Exception, match="takes no argument 'conc'; it takes concentration"):
        BayesNCLHead(D, K, H, num_train=500, prior="beta-bernoulli", prior_args={"conc": 5})


def test_the_example_trains_a_torchvision_backbone_in_a_plain_loop(monkeypatch, capsys):
    assert len(EXAMPLE.read_text().splitlines()) <= 60
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--steps", "2", "--batch-size", "8"])
    runpy.run_path(str(EXAMPLE), run_name="__main__")  # in-process: the interpreter's start-up is not what is tested
    out = capsys.readouterr().out
    assert "step 2: loss" in out and "of the gates open" in out


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


def test_the_prior_gradient_is_the_loss_gradient_over_lambda_along_the_programs_path_only():
    """The head divides the gradient that reaches the prior's parameters through its program by lambda, read at each
    step; a gradient the user takes of the parameter elsewhere (autograd.grad of the prior's own log-density) is the
    plain one (a hook on the parameter divided it as well: 1000x at lambda 1e-3); a prior object may be called by
    two heads."""
    from bayesncl_pyro.models.priors import LearnedPrior

    prior = LearnedPrior(K, 0.8)
    head = BayesNCLHead(D, K, H, num_train=500, prior=prior, kl_weight=0.01)
    h = torch.randn(R, D)
    head(h)[0].backward()
    (p,) = head.prior_parameters()
    divided = p.grad.clone()
    p.grad = None
    head.model.kl_weight = head.guide.kl_weight = 0.02  # lambda changed (a schedule): the division follows
    head(h)[0].backward()
    torch.testing.assert_close(p.grad, divided, rtol=1e-4, atol=1e-7)  # lambda * dKL / lambda: independent of it
    g = torch.ones(3, K)
    own, = torch.autograd.grad(prior(3).log_prob(g).sum(), p)
    torch.testing.assert_close(own, 3 * (1 - prior.rate().detach()))  # d/dlogit of 3 log sigmoid(logit), undivided
    other = BayesNCLHead(D, K, H, num_train=500, prior=prior, kl_weight=0.01)
    p.grad = None
    other(h)[0].backward()
    assert torch.isfinite(p.grad).all()


def test_under_ddp_a_rank_may_hold_one_image(monkeypatch):
    """With the other ranks' rows gathered, one image per rank (2 rows) has negatives; alone it has none."""
    head = BayesNCLHead(D, K, H, num_train=500, gather_distributed=True)
    with pytest.raises(UserError, match="got 2 rows, the views of 1 image"):
        head(torch.randn(2, D))
    others = torch.randn(2, K).relu()
    monkeypatch.setattr("bayesncl_pyro.distributed.gather_rows", lambda u: (torch.cat([u, others]), 0))  # rank 1's rows
    monkeypatch.setattr("bayesncl_pyro.distributed.world_size", lambda: 2)
    loss, _ = head(torch.randn(2, D))
    assert torch.isfinite(loss)


def test_leg_is_refused_under_ddp_in_one_line(monkeypatch):
    """leg's per-gate differences see the local rows only: under DDP, where the negatives come from every rank, they
    would be wrong without a word; one process is fine."""
    head = BayesNCLHead(D, K, H, num_train=500, gate="leg", gather_distributed=True)
    assert torch.isfinite(head(torch.randn(8, D))[0])
    monkeypatch.setattr("bayesncl_pyro.distributed.world_size", lambda: 2)
    with pytest.raises(UserError, match="--gate leg trains on one process only"):
        head(torch.randn(8, D))


def test_the_test_objective_contrasts_the_local_rows_under_ddp(monkeypatch):
    """Evaluation runs on rank 0 alone: the objective's draws must not call the gather (a collective the other
    ranks have left), and contrast the batch's own rows."""
    head = BayesNCLHead(D, K, H, num_train=500, gather_distributed=True)
    calls = []
    monkeypatch.setattr("bayesncl_pyro.distributed.gather_rows", lambda u: calls.append(1) or (u, 0))
    monkeypatch.setattr("bayesncl_pyro.distributed.world_size", lambda: 2)
    h = torch.randn(8, D)
    head.objective_draw(h)
    assert not calls
    head(h)
    assert calls  # training gathers
    torch.testing.assert_close(head.mode_nce(h), info_nce_rows(head.representation(h), 0.2).mean())


def test_importing_the_package_stays_light():
    """`import bayesncl_pyro` loads neither torch nor Pyro; the head and load_run load on first use."""
    code = ("import sys, bayesncl_pyro; light = 'torch' not in sys.modules; "
            "from bayesncl_pyro import BayesNCLHead, load_run; print(light, 'pyro' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True"]


@pytest.mark.slow
def test_an_install_keeps_the_pyro_program_inside_the_package(tmp_path):
    """models/ and guides/ sit at the repository's top but install as bayesncl_pyro.models and .guides: a user's
    own top-level ``models`` package neither shadows ours nor mixes with it (a plain, non-editable install)."""
    import importlib.util
    import json
    import os

    site, user = tmp_path / "site", tmp_path / "user"
    # built with this python's setuptools where it has one (no download); a Python 3.12 venv has none
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *isolation, "--target", str(site),
                    str(Path(__file__).parents[2])], check=True, cwd=tmp_path)
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info")) == ["bayesncl_pyro"]
    (user / "models").mkdir(parents=True)
    (user / "models" / "__init__.py").write_text("MINE = True\n")
    code = ("import json, bayesncl_pyro, models; from bayesncl_pyro.models.priors import PRIORS; "
            "from bayesncl_pyro.infer.estimators import GATES; from bayesncl_pyro import BayesNCLHead; "
            "print(json.dumps([bayesncl_pyro.__file__, models.__file__, models.MINE, 'bernoulli' in PRIORS, "
            "'ste' in GATES]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=user, env={**os.environ, "PYTHONPATH": str(site)},
                         capture_output=True, text=True, check=True).stdout
    ours, theirs, mine, *registered = json.loads(out)
    assert ours.startswith(str(site)) and theirs == str(user / "models" / "__init__.py")
    assert mine and all(registered)


def test_the_logged_kl_is_summed_not_recovered_from_the_loss():
    """Gates near the prior at the published lambda: the KL per row is about 0.003 nats, far below float32's
    resolution of (loss - nce) / lambda (about 0.016 at a loss of 5), which logged it as 0 or as negative."""
    torch.manual_seed(0)
    head = BayesNCLHead(64, 256, 128, num_train=50_000, kl_weight=3e-5)
    with torch.no_grad():
        head.guide.head[-1].weight.mul_(0.001)
        head.guide.head[-1].bias.fill_(math.log(4) + 0.05)  # sigmoid a little above the prior's 0.8
    h = torch.randn(256, 64)
    _, stats = head(h)
    expected = bernoulli_kl(head.gate_probs(h).double(), 0.8, 0.01).sum(1).mean()
    assert 0.001 < expected < 0.01
    assert stats.kl.item() == pytest.approx(expected.item(), rel=1e-3)


@pytest.mark.parametrize("prior, gate", [("beta-bernoulli", "ste"), ("bernoulli", "gs-reference-kl")])
def test_the_kl_and_the_prior_pull_use_the_rate_and_probabilities_of_the_step(prior, gate):
    """For a hierarchical prior the gates' KL is taken against this step's draw from q(rate), not the prior's mean
    rate; for gs-reference-kl at sigmoid(l), not at the gate's inclusion probability. The logged KL (with the
    global latents' KL / 2N) and the prior's pull on the gates use the same."""
    torch.manual_seed(0)
    head = BayesNCLHead(D, K, H, num_train=50, prior=prior, gate=gate, kl_weight=0.05, kl_clamp=0.0, prior_prob=0.7)
    h = torch.randn(R, D)
    with pyro.validation_enabled(False):  # validation runs the program once more, drawing another rate
        pyro.set_rng_seed(5)
        loss, stats = head(h)
    pyro.set_rng_seed(5)
    q = head.guide.posterior(h)
    alpha = head.estimator.kl_probs(q).detach()
    if prior == "beta-bernoulli":
        rate_q = head.guide.rate_guide.posterior()
        rate = rate_q.rsample().detach()  # the step's draw, replayed
        global_kl = torch.distributions.kl_divergence(rate_q, dist.Beta(head.model.prior.a, head.model.prior.b))
        global_kl = global_kl.sum().detach() / head.num_rows
        assert not torch.allclose(rate, head.model.prior.mean_rate())
    else:
        rate, global_kl = torch.full((K,), 0.7), 0.0
        assert not torch.allclose(alpha, q.probs)
    torch.testing.assert_close(stats.prior_rate, rate)
    torch.testing.assert_close(stats.kl_probs, alpha)
    torch.testing.assert_close(stats.kl, bernoulli_kl(alpha, rate, 0.0).sum(1).mean() + global_kl)
    loss.backward()
    alpha.requires_grad_()
    pull, = torch.autograd.grad(bernoulli_kl(alpha, rate, 0.0).sum(), alpha)
    assert head.pulls(stats)["gate_prior_pull"] == pytest.approx(0.05 * pull.abs().mean().item(), rel=1e-5)


@pytest.mark.parametrize("prior", ["bernoulli", "per-image"])
def test_the_prior_pull_takes_each_row_against_its_own_rates(prior):
    """pulls' prior pull is lambda |dKL / dalpha| at each row's rates: under per-image every row has its own (the first
    row's for all gave another figure); under a shared rate the figure is the one against the K rates, to the bit."""
    torch.manual_seed(0)
    head = BayesNCLHead(8, 4, 8, num_train=100, prior=prior, kl_weight=0.05, kl_clamp=0.0)
    with pyro.validation_enabled(False):
        loss, out = head(torch.randn(6, 8))
    loss.backward()
    rates = out.prior.mean.detach()
    assert rates.shape == (6, 4)
    by_row = gate_pulls(out.gates.grad, out.kl_probs, rates, 0.05, 0.0)[1]
    first_row = gate_pulls(out.gates.grad, out.kl_probs, out.prior_rate, 0.05, 0.0)[1]
    assert head.pulls(out)["gate_prior_pull"] == by_row
    if prior == "bernoulli":
        assert by_row == first_row
    else:
        assert not torch.allclose(rates, rates[:1].expand_as(rates)) and by_row != pytest.approx(first_row)


@pytest.mark.parametrize("kwargs, message", [
    (dict(kl_clamp=0.5), r"kl_clamp must lie in \[0, 0.5\), got 0.5"),
    (dict(logit_bound=0.0), "logit_bound must be positive, got 0.0; pass e.g. 5.0"),
    (dict(kl_weight=0.0), "kl_weight must be positive, got 0.0; pass e.g. 3e-5 .*no prior"),
    (dict(kl_weight=-1.0), "kl_weight must be positive"),
    (dict(temperature=0), "temperature must be positive, got 0"),
    (dict(head_depth=0), "head_depth must be positive"),
    (dict(topk=9), r"topk must lie in \[0, proj_dim=8\], got 9"),
    (dict(gate="hard", nonneg="abs"),
     "^unknown gate 'hard'; choose one of: ste, relaxed, st-sampled, leg, gs, gs-reference-kl$"),
    (dict(nonneg="abs"), "^unknown nonneg 'abs'; choose one of: relu, rep_relu, none$"),
    (dict(num_train=1), "num_train must be the number of images in the training set"),
    (dict(prior=None, prior_args={"concentration": 3}), "prior=None has no prior to take them"),
    (dict(prior=BetaBernoulliPrior(K, 0.6), prior_args={"concentration": 3}),
     "a BetaBernoulliPrior is built already: pass them to its constructor"),
    (dict(prior=BetaBernoulliPrior(4, 0.6)), "the prior has 4 gates but the head 8 features; build the prior with "
                                             "num_features=8"),
])
def test_each_bad_argument_is_refused_in_one_line_naming_it(kwargs, message):
    with pytest.raises(UserError, match=message) as err:
        BayesNCLHead(D, K, H, **{"num_train": 500, **kwargs})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("flag, value, message", [
    ("kl_clamp", 0.7, r"--kl-clamp must lie in \[0, 0.5\)"), ("logit_bound", 0.0, "--logit-bound must be positive"),
    ("gate", "hard", "unknown --gate 'hard'"), ("topk", 99, r"--topk must lie in \[0, --proj-dim=64\]")])
def test_the_config_checks_the_head_arguments_by_their_flags(flag, value, message):
    with pytest.raises(UserError, match=message):
        resolve(Config(dataset="digits", **{flag: value}))


@pytest.mark.parametrize("rows, message", [
    (7, "got 7 rows, an odd number: the head takes the rows of both views"),
    (2, "got 2 rows, the views of 1 image: InfoNCE needs another image"),
    (12, "a batch of 6 images, but num_train=4: num_train is the number of images in the training set"),
])
def test_a_batch_the_loss_would_get_wrong_is_refused(rows, message):
    head = BayesNCLHead(D, K, H, num_train=4)
    with pytest.raises(UserError, match=message):
        head(torch.randn(rows, D))
    with pytest.raises(UserError, match="R x D backbone features, got a tensor of shape"):
        head(torch.randn(2, 4, D))


def test_a_head_without_gates_says_so():
    head = BayesNCLHead(D, K, H, num_train=500, prior=None)
    with pytest.raises(UserError, match="this head has no gates"):
        head.gate_probs(torch.randn(R, D))


def _prior_step(head, optimizer_class, lr, h):
    optimizer = optimizer_class(head.param_groups(lr, gate_lr=lr), lr=lr)
    before = head.model.prior.logit_rate_unconstrained.detach().clone()
    head(h)[0].backward()
    optimizer.step()
    return head.model.prior.logit_rate_unconstrained.detach() - before


def test_the_learned_priors_step_does_not_depend_on_lambda_under_any_optimiser():
    """Its gradient arrives divided by lambda: with SGD the step is lambda-free at the gating head's lr, with Adam
    (scale-free) it is that lr, not lr / lambda (the former param_groups took lr / lambda unless told adam=True)."""
    h = torch.randn(R, D)
    steps = {}
    for lam in (1e-3, 1e-2):
        torch.manual_seed(0)
        steps[lam] = _prior_step(BayesNCLHead(D, K, H, num_train=500, prior="learned", kl_weight=lam),
                                 torch.optim.SGD, 0.5, h)
    assert steps[1e-3].abs().max() > 1e-3
    torch.testing.assert_close(steps[1e-3], steps[1e-2], rtol=1e-4, atol=1e-7)
    torch.manual_seed(0)
    adam = _prior_step(BayesNCLHead(D, K, H, num_train=500, prior="learned", kl_weight=1e-3), torch.optim.Adam, 0.01, h)
    torch.testing.assert_close(adam.abs(), torch.full((K,), 0.01), rtol=1e-3, atol=0)  # Adam's first step: lr


def test_a_copy_of_the_head_divides_the_priors_gradient_as_the_original():
    """Tensor hooks do not travel with a deep copy or a pickle: the copy registers its own at its first step."""
    import io

    torch.manual_seed(0)
    head = BayesNCLHead(D, K, H, num_train=500, prior="beta-bernoulli", kl_weight=1e-3, gate="ste")
    h = torch.randn(R, D)
    head(h)  # hooked, and its record of them kept
    copy_ = copy.deepcopy(head)
    saved = io.BytesIO()
    torch.save(head, saved)
    saved.seek(0)
    pickled = torch.load(saved, weights_only=False)
    for module in (head, copy_, pickled):
        module.zero_grad()
        with pyro.validation_enabled(False):
            pyro.set_rng_seed(1)
            module(h)[0].backward()
    for (name, a), b, c in zip(head.named_parameters(), copy_.parameters(), pickled.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
        torch.testing.assert_close(a.grad, c.grad, msg=name)
    assert head.guide.rate_guide.a_unconstrained.grad.abs().max() > 1e-3  # divided by lambda, not lambda-sized


@pytest.mark.parametrize("gate", ["gs", "gs-reference-kl", "ste"])
def test_the_evaluation_mask_is_the_mode_but_for_gs_reference_kl_the_references(gate):
    torch.manual_seed(0)
    head = BayesNCLHead(D, K, H, num_train=500, gate=gate, logit_bound=1.0)
    h = torch.randn(64, D)
    logits = head.guide.logits(h)
    alpha = logits.sigmoid() if gate == "gs-reference-kl" else head.gate_probs(h)
    between = (logits > -0.367) & (logits < 0)  # open at the gs mode, closed at sigmoid(l) > 0.5
    assert between.any()
    mask = (alpha > 0.5).float()
    torch.testing.assert_close(head.gate_mask(h), mask)
    torch.testing.assert_close(head.representation(h), normalize(head.model.features(head.projector(h)) * mask))


def test_the_gating_mlp_runs_under_the_callers_autocast_and_keeps_the_loss_to_float64():
    """Under its caller's autocast (bf16 on the CPU here, as the learner's on a GPU) the gating head's MLP runs in
    bf16, as the projector, and the rest of the program in float32: the loss and the inclusion probabilities stay within
    bf16's rounding of a float64 copy's; outside the head's forward (evaluation) the MLP runs in its inputs' dtype."""
    torch.manual_seed(0)
    head = BayesNCLHead(64, 32, 128, num_train=500, gate="leg", kl_weight=0.05)  # leg: no mode, no gate on the edge
    h = torch.randn(32, 64)
    dtypes = []
    head.guide.head[0].register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    pyro.set_rng_seed(0)
    expected_loss, expected = copy.deepcopy(head).double()(h.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pyro.set_rng_seed(0)
        loss, stats = head(h)
    assert dtypes[-1] == torch.bfloat16 and loss.dtype == stats.probs.dtype == torch.float32
    assert abs(loss.item() - expected_loss.item()) <= 2e-2 * abs(expected_loss.item())
    assert (stats.probs.double() - expected["probs"]).abs().max() < 2e-2
    head.gate_probs(h)
    assert dtypes[-1] == torch.float32 and "mlp_autocast" not in vars(head.guide)  # nothing toggled on the guide


def test_a_forward_pass_changes_nothing_and_the_density_moves_at_the_explicit_update():
    """With a density target, the head's forward (in training mode) leaves the multiplier as it was and lambda at
    kl_weight; ``update_density`` after the step takes its dual step from that step's share of open gates (or from a
    share given as a tensor, for SVI), and the next forward carries the new multiplier."""
    torch.manual_seed(0)
    head = BayesNCLHead(D, K, H, num_train=500, prior_prob=0.2, gate_density=0.3, kl_weight=0.05).train()
    h = torch.randn(R, D)
    state = {k: v.clone() for k, v in head.state_dict().items()}
    loss, out = head(h)
    for k, v in head.state_dict().items():  # the target is NaN before the first update
        torch.testing.assert_close(v, state[k], rtol=0, atol=0, equal_nan=True, msg=k)
    assert out.kl_weight == pytest.approx(0.05)
    control = copy.deepcopy(head.density)
    control.update(out.gates_open)
    head.update_density(out)
    assert torch.equal(head.density.integral, control.integral)
    assert not torch.equal(head.density.target, state["density.target"])
    _, after = head(h)
    assert torch.equal(after.density_multiplier, control.multiplier()) and after.kl_weight == pytest.approx(0.05)
    control.update(torch.tensor(0.9))
    head.update_density(torch.tensor(0.9))
    assert torch.equal(head.density.multiplier(), control.multiplier())


def test_the_guide_under_the_estimator_is_built_once_and_again_for_a_new_estimator_guide_or_copy():
    """The ``poutine.reparam`` handler of the guide is kept between steps; replacing the estimator or the guide, or
    copying the head, gives a handler around the new one, and the program it runs is the head's own."""
    import io

    torch.manual_seed(0)
    head = BayesNCLHead(D, K, H, num_train=500, gate="ste")
    h = torch.randn(R, D)
    trained = head._trained_guide()
    assert head._trained_guide() is trained and trained.fn is head.guide
    head.estimator = type(head.estimator)(kl_clamp=0.0)
    assert head._trained_guide() is not trained
    assert head._trained_guide().msngr.config["g"] is head.estimator
    saved = io.BytesIO()
    torch.save(head, saved)
    saved.seek(0)
    for copied in (copy.deepcopy(head), torch.load(saved, weights_only=False)):
        assert copied._trained_guide().fn is copied.guide
        with pyro.validation_enabled(False):
            assert torch.equal(copied(h)[0], head(h)[0])
    head.guide = copy.deepcopy(head.guide)
    assert head._trained_guide().fn is head.guide
