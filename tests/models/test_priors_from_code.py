"""--prior package.module:Class and --prior-arg: a prior from code outside the repository, its arguments checked
against its constructor, saved in the config, and rebuilt on resume and by load_learner."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pyro
import pyro.distributions as dist
import pytest
import torch
from helpers import RUN_SVI, TINY_RUN
from pyro.nn import PyroModule

from bayesncl_pyro import BayesNCLHead
from bayesncl_pyro.cli import run_svi
from bayesncl_pyro.config import Config
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate.loading import load_learner
from bayesncl_pyro.models.priors import BernoulliPrior, Prior
from bayesncl_pyro.train.resolve import resolve

PRIOR_CODE = '''
    import torch

    from bayesncl_pyro.models.priors import Prior


    class SteppedPrior(Prior):
        """rho on the first half of the gates, rho * scale on the second."""

        def __init__(self, num_features: int, prior_prob: float = 0.8, scale: float = 0.5, hard: bool = False):
            super().__init__(num_features, prior_prob)
            if not 0 < scale <= 1:
                raise ValueError(f"scale must lie in (0, 1], got {scale}")
            rate = torch.full((num_features,), self.prior_prob)
            rate[num_features // 2:] *= scale
            self.register_buffer("_rate", rate)

        def rate(self):
            return self._rate
'''


@pytest.fixture
def prior_code(tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "my_priors.py").write_text(textwrap.dedent(PRIOR_CODE))
    yield code
    sys.modules.pop("my_priors", None)  # another test's my_priors must not find this one imported


def test_a_prior_from_your_own_module_trains_resumes_and_reloads(tmp_path, prior_code, monkeypatch, capsys):
    out = tmp_path / "run"
    args = [*TINY_RUN, "--prior", "my_priors:SteppedPrior", "--prior-arg", "scale=0.25", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(prior_code), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(RUN_SVI), *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "my_priors:SteppedPrior prior rho=0.8 scale=0.25" in proc.stdout.splitlines()[0]
    saved = json.loads((out / "config.json").read_text())
    assert saved["prior"] == "my_priors:SteppedPrior" and saved["prior_args"] == {"scale": 0.25}

    monkeypatch.syspath_prepend(str(prior_code))
    learner, cfg = load_learner(out, trust_code=True)
    assert type(learner.model.prior).__name__ == "SteppedPrior" and cfg.prior_args == {"scale": 0.25}
    torch.testing.assert_close(learner.model.prior.rate(), torch.tensor([0.8] * 8 + [0.2] * 8))
    # the same command resumes it (here: finds it finished); "2.5e-1" is the same value
    assert run_svi.main([a.replace("scale=0.25", "scale=2.5e-1") for a in args]) == 0
    assert "already holds a finished run" in capsys.readouterr().out
    # another value is another run
    assert run_svi.main([a.replace("scale=0.25", "scale=0.5") for a in args]) == 2
    assert "prior_args: {'scale': 0.25} -> {'scale': 0.5}" in capsys.readouterr().err


@pytest.mark.parametrize("prior_args, message", [
    (["scal=0.5"], "--prior-arg scal: prior my_priors:SteppedPrior takes no argument 'scal'; it takes scale, hard"),
    (["scale=abc"], "--prior-arg scale=abc: prior my_priors:SteppedPrior's scale takes a float"),
    (["hard=maybe"], "hard takes true or false"),
    (["scale=2"], r"--prior my_priors:SteppedPrior \(scale=2.0\) refused its arguments: scale must lie in \(0, 1\]"),
    (["prior_prob=0.5"], "--prior-arg prior_prob: set it with --prior-prob"),
])
def test_bad_prior_arguments_are_one_line(prior_code, monkeypatch, capsys, prior_args, message):
    monkeypatch.syspath_prepend(str(prior_code))
    argv = [*TINY_RUN, "--prior", "my_priors:SteppedPrior", "--out", "unused"]
    for a in prior_args:
        argv += ["--prior-arg", a]
    assert run_svi.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert re.search(message, err), err


def test_registry_priors_take_arguments_and_a_missing_module_is_named():
    cfg = resolve(Config(dataset="digits", prior="beta-bernoulli", prior_args={"concentration": "5"}))
    assert cfg.prior_args == {"concentration": 5.0}
    with pytest.raises(UserError, match="Beta concentration must be positive, got -1.0; pass e.g. --prior-arg"):
        resolve(Config(dataset="digits", prior="beta-bernoulli", prior_args={"concentration": -1}))
    with pytest.raises(UserError, match="--prior nowhere:Prior: cannot import nowhere .*PYTHONPATH"):
        resolve(Config(dataset="digits", prior="nowhere:Prior"))
    with pytest.raises(UserError, match="--prior torch:Tensor is not a subclass of .*Prior"):
        resolve(Config(dataset="digits", prior="torch:Tensor"))
    with pytest.raises(SystemExit):  # argparse: "expected NAME=VALUE"
        run_svi.parser().parse_args(["--prior-arg", "concentration"])


class _BetaRate(Prior):
    """A hierarchical prior whose guide is its own business (here: missing, or sampling the wrong site)."""

    guide_site = None

    def rate(self):
        return pyro.sample("r", dist.Beta(torch.full((self.num_features,), 8.0), 2.0).to_event(1))

    def make_guide(self):
        if self.guide_site is None:
            return None
        return _SiteGuide(self.guide_site, self.num_features)


class _SiteGuide(PyroModule):
    def __init__(self, site, num):
        super().__init__()
        self.site, self.num = site, num

    def forward(self):
        return pyro.sample(self.site, dist.Beta(torch.full((self.num,), 5.0), 5.0).to_event(1))


class _WrongGuide(_BetaRate):
    guide_site = "rate"


class _RightGuide(_BetaRate):
    guide_site = "r"


class _OutsideRate(Prior):
    def rate(self):
        return torch.full((self.num_features,), 1.5)


class _WrongLength(Prior):
    def rate(self):
        return torch.full((self.num_features + 1,), 0.5)


class _OneRowOfGates(Prior):
    """A distribution of its own (forward), over one row's gates whatever the batch."""

    def forward(self, rows):
        return dist.Bernoulli(torch.full((self.num_features,), 0.5)).to_event(1)


@pytest.mark.parametrize("prior, message", [
    (_BetaRate, r"_BetaRate samples the latent sites \['r'\] but its make_guide\(\) returns no guide: "
                r"make_guide\(\) must return a guide"),
    (_WrongGuide, r"samples the latent sites \['r'\] but its make_guide\(\) returns a guide that samples \['rate'\]"),
    (_OutsideRate, r"_OutsideRate.rate\(\) returned rates outside \[0, 1\] \(from 1.5 to 1.5\)"),
    (_WrongLength, r"_WrongLength.rate\(\) returned shape \(9,\); it must return the 8 gates' inclusion rates"),
    (_OneRowOfGates, r"_OneRowOfGates\(2\) returned batch shape \(\) and event shape \(8,\); it must return the "
                     r"distribution of 2 rows' gates, batch shape \(2,\) and event shape \(8,\)"),
])
def test_a_prior_that_does_not_fit_the_program_is_refused_when_the_head_is_built(prior, message):
    """Not a bare KeyError inside the ELBO, a broadcast error, or (a rate outside (0, 1), hidden by the KL's clamp)
    silent training."""
    with pytest.raises(UserError, match=message):
        BayesNCLHead(6, 8, 16, num_train=100, prior=prior(8, 0.8))


def test_a_prior_with_its_own_guide_trains_and_checking_it_draws_nothing():
    """The check runs the prior and its guide on a forked random stream: the weights initialised after it are
    those of a head whose prior draws nothing."""
    heads = []
    for prior in (_RightGuide(8, 0.8), "bernoulli"):
        torch.manual_seed(0)
        heads.append(BayesNCLHead(6, 8, 16, num_train=100, prior=prior))
    torch.testing.assert_close(heads[0].guide.head[0].weight, heads[1].guide.head[0].weight, rtol=0, atol=0)
    loss, _ = heads[0](torch.randn(10, 6))
    assert torch.isfinite(loss)


class _BinomialGates(Prior):
    """Bernoulli gates in law, written as Binomial(1, rho): a distribution no KL against q is registered for."""

    def forward(self, rows):
        return dist.Binomial(1, torch.full((rows, self.num_features), self.prior_prob)).to_event(1)


@pytest.mark.parametrize("gate", ["ste", "leg"])
def test_a_prior_without_a_registered_kl_that_factorises_gets_the_exact_kl(gate):
    """The same head and draws with a prior of the same law, once as the Bernoulli (analytic KL), once as a
    Binomial (no KL registered against q: each gate's KL enumerated over its two values): the same loss, KL and
    gradients, where the one-draw log q - log p at the gates' value (for ste the mode, no draw of q) trained a
    wrong gradient without a word."""
    h = torch.randn(10, 6)
    runs = []
    for prior in (BernoulliPrior(8, 0.7), _BinomialGates(8, 0.7)):
        torch.manual_seed(0)
        head = BayesNCLHead(6, 8, 16, num_train=100, prior=prior, gate=gate, kl_clamp=0.0, kl_weight=0.1)
        pyro.set_rng_seed(1)
        loss, stats = head(h)
        loss.backward()
        runs.append((loss, stats, head.guide.head[0].weight.grad, head.kl_kind))
    (loss, stats, grad, kind), (mc_loss, mc_stats, mc_grad, mc_kind) = runs
    assert kind == {"g": "analytic"} and mc_kind == {"g": "exact, enumerated per gate"}
    torch.testing.assert_close(mc_loss, loss)
    torch.testing.assert_close(mc_stats.kl, stats.kl)
    torch.testing.assert_close(mc_grad, grad)
    torch.testing.assert_close(mc_stats.prior_rate, torch.full((8,), 0.7))
