import json
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
import xarray as xr
from pyro.nn import PyroModule, PyroParam
from torch.distributions import constraints

from bayesncl_pyro.config import Config
from bayesncl_pyro.data import load_dataset
from bayesncl_pyro.data.views import eval_transform
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate import heldout
from bayesncl_pyro.evaluate.arviz_export import ARVIZ_1, export_gates, read_gates
from bayesncl_pyro.evaluate.posterior import gate_posterior
from bayesncl_pyro.infer.estimators import GATES
from bayesncl_pyro.infer.learner import ContrastiveLearner
from bayesncl_pyro.models.priors import Prior
from bayesncl_pyro.train.resolve import resolve


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits", None, seed=0)


def learner_for(data, **kw):
    cfg = resolve(Config(dataset="digits", proj_hidden=32, proj_dim=16, workers=0, **kw))
    return ContrastiveLearner(cfg, data.channels, len(data.train)).eval()


@pytest.mark.parametrize("gate", sorted(GATES))
def test_probabilities_are_each_gates_inclusion_probability_of_the_guide_logits(digits, gate):
    learner = learner_for(digits, gate=gate)
    post = gate_posterior(learner, digits)
    transform = eval_transform(8, digits.channels)
    x = torch.stack([transform(digits.test[i][0]) for i in range(len(digits.test))])
    with torch.no_grad():
        h = learner.backbone(x)
        expected = GATES[gate].family.inclusion(learner.guide.logits(h))
    assert post.probs.shape == (len(digits.test), 16) and post.draws is None
    torch.testing.assert_close(post.probs, expected)
    assert post.labels.tolist() == [digits.test[i][1] for i in range(len(digits.test))]
    three = post.labels == 3
    torch.testing.assert_close(post.class_means[3], expected[three].mean(0))
    assert post.class_means.shape == (10, 16)


@pytest.mark.parametrize("gate", ["ste", "relaxed", "gs"])
def test_draws_are_draws_from_q_for_every_estimator(digits, gate):
    """gates.nc's draws come from q(g | x) = Bernoulli(probs), also for the deterministic ste gate (which trains
    on the mode): they spread, and their mean is the reported inclusion probability."""
    post = gate_posterior(learner_for(digits, gate=gate), digits, num_draws=400)
    assert post.draws.shape == (400, len(digits.test), 16)
    assert set(post.draws.unique().tolist()) <= {0.0, 1.0}
    # 400 Bernoulli draws: the per-entry standard error is at most 0.025, its mean over entries ~0.016
    assert (post.draws.mean(0) - post.probs).abs().mean() < 0.025
    uncertain = (post.probs > 0.1) & (post.probs < 0.9)
    assert uncertain.any() and (post.draws.std(0)[uncertain] > 0.2).all()  # spread, not copies of the mode
    assert post.global_draws is None and post.global_params is None


def test_the_evaluations_test_features_serve_the_posterior_without_another_pass(digits):
    """A run's evaluation and its gates.nc read one pass of the backbone over the test split: given that pass's
    test features, the gate posterior is the one it computes on its own, and the backbone does not run again."""
    learner = learner_for(digits)
    own = gate_posterior(learner, digits)
    test = heldout.test_features(learner, digits)
    ran = []
    hook = learner.backbone.register_forward_pre_hook(lambda module, args: ran.append(len(args[0])))
    try:
        shared = gate_posterior(learner, digits, num_draws=2, test=test)
    finally:
        hook.remove()
    assert ran == []
    for name in ("probs", "features", "labels", "class_means"):
        assert torch.equal(getattr(shared, name), getattr(own, name)), name
    assert shared.draws.shape == (2, len(digits.test), 16)


def test_beta_bernoulli_exposes_the_rate_posterior(digits):
    learner = learner_for(digits, prior="beta-bernoulli")
    post = gate_posterior(learner, digits, num_draws=5)
    assert post.global_params.keys() == {"a", "b"} and post.global_draws.keys() == {"rate"}
    torch.testing.assert_close(post.global_params["a"], learner.guide.rate_guide.a.detach())
    rate = post.global_draws["rate"]
    assert rate.shape == (5, 16) and ((rate > 0) & (rate < 1)).all()


class LogitNormalRate(Prior):
    """A hierarchical prior whose global latent is no Beta rate: logit(rho_k) ~ Normal(logit(prior_prob), 1),
    q(logit(rho_k)) = Normal(loc_k, scale_k), and a scalar parameter besides, of no dimension."""

    def forward(self, rows):
        loc = torch.full((self.num_features,), self.prior_prob).logit()
        logit_rate = pyro.sample("logit_rate", dist.Normal(loc, 1.0).to_event(1))
        return dist.Bernoulli(logits=logit_rate.expand(rows, -1)).to_event(1)

    def make_guide(self):
        return _NormalGuide(self.num_features)


class _NormalGuide(PyroModule):
    def __init__(self, k):
        super().__init__()
        self.loc = PyroParam(torch.linspace(-1.0, 2.0, k))
        self.scale = PyroParam(torch.full((k,), 0.5), constraint=constraints.positive)
        self.spread = PyroParam(torch.tensor(1.0), constraint=constraints.positive)

    def forward(self):
        return pyro.sample("logit_rate", dist.Normal(self.loc, self.scale * self.spread).to_event(1))


def test_a_hierarchical_prior_of_any_kind_exports_its_global_latents_by_name(digits, tmp_path):
    """gates.nc reads the prior's guide by its sites' names: its draws (here not a rate) and its parameters."""
    learner = learner_for(digits, prior="test_posterior:LogitNormalRate")
    path = export_gates(tmp_path, learner, digits, num_draws=3)
    idata = read_gates(path.parent)
    assert idata.posterior["logit_rate"].dims == ("chain", "draw", "feature") and "rate" not in idata.posterior
    np.testing.assert_array_equal(idata.gates["rate_loc"].values, torch.linspace(-1.0, 2.0, 16).numpy())
    np.testing.assert_allclose(idata.gates["rate_scale"].values, 0.5)
    assert float(idata.gates["rate_spread"]) == pytest.approx(1.0) and idata.gates["rate_spread"].dims == ()
    assert "converged" not in idata.posterior["logit_rate"].attrs  # no convergence figure for this prior
    draws = idata.posterior["logit_rate"].values[0]
    assert draws.shape == (3, 16) and not np.array_equal(draws[0], draws[1])
    # the report's prior rate: a row's P(g = 1) averaged over q's draws, near E_q[sigmoid(logit_rate)]
    state = torch.get_rng_state()
    rate = learner.model.prior.mean_rate(learner.guide.rate_guide, num_draws=4000)
    assert torch.equal(torch.get_rng_state(), state)  # drawn on a stream of its own
    exact = dist.Normal(torch.linspace(-1.0, 2.0, 16), 0.5).sample((100_000,)).sigmoid().mean(0)
    torch.testing.assert_close(rate, exact, atol=0.01, rtol=0)


def test_ungated_runs_are_refused(digits):
    with pytest.raises(UserError, match="no gates"):
        gate_posterior(learner_for(digits, method="ncl"), digits)


@pytest.mark.parametrize("prior", ["bernoulli", "beta-bernoulli"])
def test_export_round_trip_keeps_every_number(digits, tmp_path, prior):
    learner = learner_for(digits, prior=prior)
    (tmp_path / "config.json").write_text(json.dumps(learner.cfg.to_dict()))
    log = [dict(step=10, loss=6.5, nce=6.4, kl=3.0), dict(step=20, loss=6.1, nce=6.0, kl=2.5, gate_rate=0.7)]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    torch.manual_seed(1)
    path = export_gates(tmp_path, learner, digits, num_draws=3)
    assert path == tmp_path / "gates.nc"
    torch.manual_seed(1)
    post = gate_posterior(learner, digits, num_draws=3)

    idata = read_gates(tmp_path)
    np.testing.assert_array_equal(idata.posterior["g"].values[0], post.draws.numpy())
    np.testing.assert_array_equal(idata.gates["inclusion_prob"].values, post.probs.numpy())
    np.testing.assert_allclose(idata.gates["class_inclusion"].values, post.class_means.numpy())
    np.testing.assert_array_equal(idata.observed_data["label"].values, post.labels.numpy())
    assert list(idata.gates["class"].values) == digits.classes
    assert idata.posterior["class_label"].values[0] == digits.classes[post.labels[0]]
    assert idata.posterior["g"].dims == ("chain", "draw", "item", "feature")
    np.testing.assert_array_equal(idata.training_log["loss"].values, [6.5, 6.1])
    np.testing.assert_array_equal(idata.training_log["step"].values, [10, 20])
    assert np.isnan(idata.training_log["gate_rate"].values[0])  # absent from the first record
    assert json.loads(idata.posterior.attrs["config"]) == learner.cfg.to_dict()
    assert idata.posterior.attrs["inference"] == "variational" and "not MCMC" in idata.posterior.attrs["note"]
    assert idata.posterior.attrs["prior"] == prior
    if prior == "beta-bernoulli":
        np.testing.assert_array_equal(idata.gates["rate_b"].values, post.global_params["b"].numpy())
        np.testing.assert_array_equal(idata.posterior["rate"].values[0], post.global_draws["rate"].numpy())
        # an untrained q(rate) is the hyperprior, concentration 10 against 10 + 2N: marked as not converged
        optimum = 10 + 2 * len(digits.train)
        for var in (idata.gates["rate_a"], idata.gates["rate_b"], idata.posterior["rate"]):
            assert var.attrs["converged"] == "no"
            assert f"a + b 10 (mean over features) against {optimum}" in var.attrs["note"]
    else:
        assert "rate" not in idata.posterior


def test_read_gates_gives_what_the_installed_arviz_summarises(digits, tmp_path):
    export_gates(tmp_path, learner_for(digits), digits, num_draws=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # arviz 0.2x announces 1.x on import
        import arviz as az
    data = read_gates(tmp_path / "gates.nc")
    if ARVIZ_1:
        assert isinstance(data, xr.DataTree)
    else:
        assert isinstance(data, az.InferenceData)
    summary = az.summary(data, var_names=["dim_inclusion"], kind="stats")
    assert len(summary) == 16
    np.testing.assert_allclose(summary["mean"], data.posterior["dim_inclusion"].mean(("chain", "draw")), atol=0.01)
    assert data["gates"]["class_inclusion"].to_pandas().shape == (10, 16)


def test_reading_a_folder_without_gates_says_so(tmp_path):
    with pytest.raises(UserError, match="no gates file at .*gates.nc"):
        read_gates(tmp_path)


@pytest.mark.parametrize("error, message", [(OSError(28, "No space left on device"), "No space left on device"),
                                            (ImportError("No module named 'h5py'"), "h5py")])
def test_a_failed_export_keeps_the_old_file_and_no_temporary(digits, tmp_path, monkeypatch, error, message):
    (tmp_path / "gates.nc").write_bytes(b"previous")

    def half_write(self, f, **kw):  # f: the temporary file rundir.atomic_save opened
        f.write(b"half")
        raise error

    monkeypatch.setattr(xr.DataTree, "to_netcdf", half_write)
    with pytest.raises(UserError, match=message):
        export_gates(tmp_path, learner_for(digits), digits, num_draws=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gates.nc"]
    assert (tmp_path / "gates.nc").read_bytes() == b"previous"
