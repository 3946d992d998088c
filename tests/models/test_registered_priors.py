"""The priors that a rate alone cannot express (models/priors.py): ibp's stick-breaking rates, logit-normal's Normal
on each dimension's logit rate, and per-image's rate per row with an amortized guide. Each one's rates and mean rate,
its latents' sites and KL, and a digits run through training, gates.nc, the notebook's figures and the report."""

import json
import math
import warnings

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import scipy.special
import torch
from helpers import TINY_RUN
from pyro.nn import PyroModule
from torch.distributions import kl_divergence

from bayesncl_pyro import BayesNCLHead
from bayesncl_pyro.cli import run_svi
from bayesncl_pyro.data import load_dataset
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate import figures, heldout, report
from bayesncl_pyro.evaluate.arviz_export import read_gates
from bayesncl_pyro.evaluate.loading import load_learner
from bayesncl_pyro.evaluate.posterior import prior_rate
from bayesncl_pyro.models.priors import PerImagePrior, Prior, build_prior, stick_alpha


@pytest.mark.parametrize("k, rate", [(16, 0.8), (256, 0.3), (2048, 0.05)])
def test_ibp_rates_decay_with_k_and_their_prior_mean_over_the_dims_is_prior_prob(k, rate):
    """The prior mean rate E[rho_k] (by quadrature over alpha) decays with k, averages prior_prob over the K dims,
    and is the mean of the prior's own draws of the rates."""
    prior = build_prior("ibp", k, rate)
    mean = prior.mean_rate()
    assert (mean[1:] < mean[:-1]).all()
    assert float(mean.double().mean()) == pytest.approx(rate, abs=1e-4)
    torch.manual_seed(0)
    draws = torch.stack([prior.rate() for _ in range(4000)])
    torch.testing.assert_close(mean, draws.mean(0), atol=0.012, rtol=0)
    assert stick_alpha(k, rate) < prior.alpha  # a fixed alpha of that mean would decay slower than the mixture's


def test_ibp_at_the_defaults_leaves_the_speed_of_the_decay_to_the_data():
    """K = 256 at rate 0.8: with alpha fixed (553) the sticks were Beta(553, 1), sd 0.002, and the rate halfway down
    the dims was 0.79 +- 0.01 before any data; with alpha's Gamma hyperprior the prior leaves it wide open, and alpha
    is a latent with a posterior of its own."""
    prior = build_prior("ibp", 256, 0.8)
    torch.manual_seed(0)
    halfway = torch.stack([prior.rate()[128] for _ in range(2000)])
    assert halfway.std() > 0.1
    head = BayesNCLHead(6, 256, 16, num_train=100, prior=prior)
    # Pyro's AutoNormal over alpha and the sticks: no registered KL, one pathwise draw each (with the Jacobian)
    assert head.kl_kind == {"g": "analytic", **{site: "Monte Carlo, one pathwise draw" for site in
                                               ("alpha", "stick", "alpha_unconstrained", "stick_unconstrained")}}


def test_ibp_sticks_pulled_towards_one_stay_finite():
    """Gates all open against a sparse ibp prior pull every stick towards 1, with the prior's gradients divided by a
    small lambda. A Beta q per stick then grew its a about twofold a step (to 1e7) until Beta's reparameterised
    gradient was NaN, at step 27 here and at step 36 of a compositional run at --gate-density 0.3; the sticks' q is
    now logit-normal (Pyro's AutoNormal), whose location moves linearly."""
    torch.manual_seed(0)
    head = BayesNCLHead(6, 64, 16, num_train=5000, prior="ibp", prior_prob=0.2, kl_weight=1e-4)
    with torch.no_grad():
        head.guide.head[-1].bias.fill_(3.0)  # q opens every gate
    groups = [g for g in head.param_groups(lr=0.0, gate_lr=0.1) if g["name"] == "prior"]
    optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    h = torch.randn(64, 6)
    before = head.model.prior.mean_rate(head.guide.rate_guide)
    for _ in range(60):
        loss, _ = head(h)
        optimizer.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in groups[0]["params"])
        optimizer.step()
    assert all(torch.isfinite(p).all() for p in groups[0]["params"])
    after = head.model.prior.mean_rate(head.guide.rate_guide)
    assert after.mean() > before.mean() + 0.2  # the rates did follow the open gates


@pytest.mark.parametrize("bias", [3.0, -3.0])
def test_per_image_rates_pulled_to_an_edge_stay_finite(bias):
    """Gates all open (or all closed) against a per-image prior pull every image's rate towards 1 (or 0), an image's
    2K gates at once, with the prior's gradients divided by a small lambda. Its Beta q's concentration ran from 10 to
    5.6e17 by step 34 on 3 of 10 compositional seeds at one thread; the logit-normal q's location moves linearly."""
    torch.manual_seed(0)
    head = BayesNCLHead(6, 64, 16, num_train=5000, prior="per-image", prior_prob=0.2, kl_weight=1e-4)
    with torch.no_grad():
        head.guide.head[-1].bias.fill_(bias)
    groups = [g for g in head.param_groups(lr=0.0, gate_lr=0.1) if g["name"] == "prior"]
    optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    h = torch.randn(64, 6)
    prior, guide = head.model.prior, head.guide.rate_guide
    before = prior.row_rates(guide, h).mean()
    for _ in range(60):
        loss, _ = head(h)
        optimizer.zero_grad()
        loss.backward()
        assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in groups[0]["params"])
        optimizer.step()
    after = prior.row_rates(guide, h).mean()
    assert torch.isfinite(after) and (after > before + 0.2 if bias > 0 else after < before - 0.1)


def test_ibp_mean_rate_under_q_is_the_mean_of_the_sticks_running_products():
    prior = build_prior("ibp", 16, 0.8)
    guide = prior.make_guide()
    assert prior.mean_rate(prior.make_guide(), num_draws=8).shape == (16,)  # a guide not yet run: by draws
    guide()  # an autoguide's parameters exist from its first call
    with torch.no_grad():
        guide.locs.stick = torch.linspace(0.5, 4.0, 16)
        guide.scales.stick = torch.linspace(0.1, 1.5, 16)
        draws = dist.Normal(guide.locs.stick, guide.scales.stick).sample((200_000,)).sigmoid().cumprod(-1).mean(0)
    torch.testing.assert_close(prior.mean_rate(guide, num_draws=4000), draws, atol=0.01, rtol=0)


def test_logit_normal_mean_rate_is_the_mean_of_the_sigmoid_under_q_and_prior_prob_its_median():
    prior = build_prior("logit-normal", 16, 0.8, scale=2.0)
    torch.testing.assert_close(prior.loc.sigmoid(), torch.full((16,), 0.8))
    guide = prior.make_guide()
    with torch.no_grad():
        guide.loc = torch.linspace(-3.0, 3.0, 16)
        guide.scale = torch.linspace(0.1, 4.0, 16)
        exact = dist.Normal(guide.loc, guide.scale).sample((1_000_000,)).sigmoid().mean(0)
    torch.testing.assert_close(prior.mean_rate(guide), exact, atol=2e-3, rtol=0)
    under_prior = dist.Normal(prior.loc, prior.scale).sample((1_000_000,)).sigmoid().mean(0)
    torch.testing.assert_close(prior.mean_rate(), under_prior, atol=2e-3, rtol=0)
    assert (prior.mean_rate() < 0.8).all()  # the spread pulls the mean towards 1/2
    with pytest.raises(UserError, match="scale must be positive, got 0.0; pass e.g. --prior-arg scale=1"):
        build_prior("logit-normal", 16, 0.8, scale=0)


def _terms(head, h):
    with torch.no_grad():
        return head.elbo_terms(head.projector(h), h)


@pytest.mark.parametrize("prior, site, in_rows", [("logit-normal", "logit_rate", False),
                                                 ("per-image", "image_rate", True), ("beta-bernoulli", "rate", False)])
def test_each_priors_latents_sit_where_they_belong_and_take_the_analytic_kl(prior, site, in_rows):
    """Global latents scaled by lambda once per data set; per-image's rate in the rows plate, scaled by lambda and
    N / R as the gates are; each one's KL term the registered KL of its q and prior, not a draw of log q - log p
    (per-image's, a logit-normal q against a Beta, has none registered: one pathwise draw)."""
    torch.manual_seed(0)
    head = BayesNCLHead(6, 8, 16, num_train=100, prior=prior, kl_weight=0.1)
    with torch.no_grad():  # q away from the prior, where both KLs would be 0
        for param in head.guide.rate_guide.parameters():
            param.add_(0.3)
    h = torch.randn(10, 6)
    terms = _terms(head, h)
    p, q = terms.model_trace.nodes[site], terms.guide_trace.nodes[site]
    scale = 0.1 * (200 / 10 if in_rows else 1.0)
    assert p["scale"] == pytest.approx(scale) and q["scale"] == pytest.approx(scale)
    assert any(f.name == "images" for f in p["cond_indep_stack"]) == in_rows  # per image: its two views share it
    assert any(f.name == "images" for f in q["cond_indep_stack"]) == in_rows
    one_draw = scale * (q["fn"].log_prob(q["value"]) - p["fn"].log_prob(q["value"])).sum()
    if prior == "per-image":  # a logit-normal q against a Beta prior: no KL registered, one pathwise draw
        torch.testing.assert_close(terms.site_kl[site], one_draw)
        assert terms.kl_kind[site] == head.kl_kind[site] == "Monte Carlo, one pathwise draw"
        return
    analytic = scale * kl_divergence(q["fn"], p["fn"]).sum()
    torch.testing.assert_close(terms.site_kl[site], analytic)
    assert not torch.isclose(terms.site_kl[site], one_draw)
    assert terms.kl_kind[site] == "analytic" and head.kl_kind[site] == "analytic"


def test_per_image_gives_each_row_its_own_rate_from_its_features():
    torch.manual_seed(0)
    head = BayesNCLHead(6, 8, 16, num_train=100, prior="per-image", gate="relaxed", kl_weight=0.1)
    prior, guide = head.model.prior, head.guide.rate_guide
    h = torch.randn(40, 6)
    # q starts at the Beta(8, 2) prior's logit mean and sd for every row, its mean rate near the prior's 0.8
    loc, scale = guide.location(h)
    torch.testing.assert_close(loc, torch.full((40,), scipy.special.digamma(8.0) - scipy.special.digamma(2.0)))
    assert scale.item() == pytest.approx(math.sqrt(scipy.special.polygamma(1, 8.0) + scipy.special.polygamma(1, 2.0)))
    torch.testing.assert_close(prior.row_rates(guide, h), torch.full((40, 8), 0.8), atol=0.01, rtol=0)
    opt = torch.optim.SGD(head.parameters(), lr=0.05)
    for _ in range(5):
        loss, _ = head(h)
        opt.zero_grad()
        loss.backward()
        opt.step()
    rates = prior.row_rates(guide, h)
    assert rates.shape == (40, 8) and (rates == rates[:, :1]).all()  # one rate per row, shared by its gates
    assert rates[:, 0].std() > 1e-4  # and rows differ
    # the closed form is the mean of the prior's gate rates over draws of the rates from q (the generic row_rates)
    torch.testing.assert_close(rates, Prior.row_rates(prior, guide, h, num_draws=4000), atol=0.01, rtol=0)
    # the prior's mean rate needs no features; q's needs them
    torch.testing.assert_close(prior.mean_rate(), torch.full((8,), 0.8))
    with pytest.raises(UserError, match="rate per row: its posterior mean rate needs the rows' backbone features"):
        prior.mean_rate(guide)


def test_per_image_gives_the_two_views_of_an_image_one_rate_read_from_both():
    """One rate per image, not per view-row: the prior's gate rates of row i and row B + i (the two views of image i)
    are one draw, and q(s_i | x_i) reads the image's two views' features (their normalised mean)."""
    torch.manual_seed(0)
    head = BayesNCLHead(6, 8, 16, num_train=100, prior="per-image", kl_weight=0.1)
    guide = head.guide.rate_guide
    with torch.no_grad():
        guide.weight.normal_()  # q away from the prior, where every image has the same rate
    h = torch.randn(10, 6)
    terms = _terms(head, h)
    rates = terms.model_trace.nodes["g"]["fn"].mean
    torch.testing.assert_close(rates[:5], rates[5:], rtol=0, atol=0)
    assert terms.guide_trace.nodes["image_rate"]["value"].shape == (5,)
    both = torch.nn.functional.normalize(h[:5], dim=-1) + torch.nn.functional.normalize(h[5:], dim=-1)
    torch.testing.assert_close(terms.guide_trace.nodes["image_rate"]["fn"].base_dist.loc, guide.location(both / 2)[0])


class _OtherSite(PyroModule):
    def forward(self, h, plate):
        with plate:
            return pyro.sample("other", dist.Beta(torch.ones(len(h)), 1.0))


class _MisnamedPerImage(PerImagePrior):
    def make_guide(self, in_dim):
        return _OtherSite()


def test_a_prior_with_row_latents_is_checked_with_its_amortized_guide():
    """A row-latent prior whose guide samples another site is refused when the head is built, as a global one's."""
    with pytest.raises(UserError, match=r"samples the latent sites \['image_rate'\] but its make_guide\(\) returns a "
                                        r"guide that samples \['other'\]"):
        BayesNCLHead(6, 8, 16, num_train=100, prior=_MisnamedPerImage(8, 0.8))


class _PerImageLocs(PyroModule):
    """A guide of per-image latents with a parameter per image, indexed by the plate's subsample."""

    def forward(self, h, plate):
        logit = pyro.param("image_logit", lambda: torch.zeros(plate.size))
        with plate as index:
            return pyro.sample("image_rate", dist.Beta(10 * logit[index].sigmoid() + 1, 2.0))


class _PerImageByIndex(PerImagePrior):
    def make_guide(self, in_dim):
        return _PerImageLocs()


def test_a_guide_with_a_parameter_per_image_is_refused():
    """Training subsamples the images plate as arange(B): such a guide would train its first B images' parameters."""
    with pytest.raises(UserError, match="_PerImageByIndex's guide keeps a parameter per image: training passes each "
                                        "batch's rows but not their indices"):
        BayesNCLHead(6, 8, 16, num_train=100, prior=_PerImageByIndex(8, 0.8))
    BayesNCLHead(6, 8, 16, num_train=100, prior=PerImagePrior(8, 0.8))  # amortised: built


@pytest.mark.parametrize("prior, site, dims", [("ibp", "stick", ("chain", "draw", "feature")),
                                              ("logit-normal", "logit_rate", ("chain", "draw", "feature")),
                                              ("per-image", "image_rate", ("chain", "draw", "item"))])
def test_a_digits_run_of_each_prior_exports_its_gates_opens_in_the_figures_and_the_report(tmp_path, prior, site,
                                                                                        dims):
    out = tmp_path / "run"
    assert run_svi.main([*TINY_RUN, "--prior", prior, "--out", str(out)]) == 0
    learner, cfg = load_learner(out)
    assert cfg.prior == prior and type(learner.model.prior).__name__ == type(build_prior(prior, 16, 0.8)).__name__

    idata = read_gates(out)
    n = idata["gates"].sizes["item"]
    assert idata["posterior"][site].dims == dims and idata.posterior.attrs["prior"] == prior
    feats = heldout.test_features(learner, load_dataset("digits", None, seed=0))
    rate = prior_rate(learner, feats)
    np.testing.assert_allclose(idata["gates"]["prior_rate"].values, rate.numpy(), rtol=1e-6)
    if prior == "per-image":  # each test image's rate, its q's mean given the image
        assert idata["gates"]["prior_rate"].dims == ("item", "feature") and rate.shape == (n, 16)
        assert (idata["posterior"][site].values > 0).all() and (idata["posterior"][site].values < 1).all()
    else:
        assert idata["gates"]["prior_rate"].dims == ("feature",)
        torch.testing.assert_close(rate, learner.model.prior.mean_rate(learner.guide.rate_guide).cpu())
    if prior == "ibp":
        assert (rate[1:] < rate[:-1]).all()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # arviz 0.2x announces 1.x on import
        import arviz as az
    assert len(az.summary(idata, var_names=["dim_inclusion"], kind="stats")) == 16
    lines = figures.inspect(out, out / "inspect")
    assert any(line.startswith("KL per dimension: mean") for line in lines)

    page = report.write_report(out)
    data = json.loads(page.with_name("report.json").read_text())
    assert data["run"]["config"]["prior"] == prior
    assert data["gates"]["prior_rate"] == pytest.approx(float(rate.mean()), abs=5e-4)  # rounded to 3 digits
