import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bayesncl_pyro.config import Config
from bayesncl_pyro.evaluate.diagnostics import (
    conflict_record,
    conflict_scores,
    degeneracy_warnings,
    nce_grad_parts,
    read_conflict,
    to_json,
)
from bayesncl_pyro.infer.head import gate_pulls
from bayesncl_pyro.infer.learner import ContrastiveLearner
from bayesncl_pyro.nn.losses import bernoulli_kl, info_nce_rows, normalize
from bayesncl_pyro.train.resolve import resolve


def test_grad_parts_sum_to_the_autograd_gradient():
    u = F.normalize(torch.randn(12, 5, dtype=torch.float64), dim=1).requires_grad_()
    info_nce_rows(u, 0.2).sum().backward()
    pos, neg = nce_grad_parts(u.detach(), 0.2)
    torch.testing.assert_close(pos + neg, u.grad)
    # the positive part alone is the gradient of the numerators
    v = u.detach().clone().requires_grad_()
    (-(v * v.roll(6, 0)).sum(1) / 0.2).sum().backward()
    torch.testing.assert_close(pos, v.grad)


def shared_dimension_batch(gen, classes=10, per_class=12, noise=0.15):
    """Non-negative rows: one dimension per class plus dimension ``classes``, which every item has.
    The two views of an image share its class and get independent noise."""
    labels = torch.arange(classes).repeat_interleave(per_class)
    base = F.one_hot(labels, classes + 1).double()
    base[:, classes] = 1.0

    def view():
        return F.normalize((base * (1 + noise * torch.randn(base.shape, generator=gen, dtype=torch.float64)))
                           .clamp_min(0), dim=1)

    return torch.cat([view(), view()])


def test_a_dimension_shared_by_all_items_scores_as_conflicted():
    gen = torch.Generator().manual_seed(0)
    recs = [conflict_record(shared_dimension_batch(gen), 0.2) for _ in range(40)]
    pos, neg, freq = (torch.stack([r[k] for r in recs]).numpy() for k in ("pos", "neg", "freq"))
    scores = conflict_scores(pos, neg)
    shared, specific = 10, slice(0, 10)
    np.testing.assert_allclose(freq[:, shared], 1.0)
    np.testing.assert_allclose(freq[:, specific], 0.1)
    # the positives pull every dimension hard, but only on the shared one do the negatives cancel it
    assert (scores["pos_mean"] < -5).all()
    assert scores["cancellation"][shared] > 0.99
    assert (scores["cancellation"][specific] < 0.8).all()
    assert (scores["total_mean"][specific] < -1).all()  # a steady pull: the class dimensions grow
    assert scores["oscillation"][shared] > 10 * scores["oscillation"][specific].max()
    assert (scores["sign_flips"][specific] == 0).all()


def test_sign_flips_count_changes_of_sign_between_measurements():
    pos = np.array([[-1.0, -1.0], [-1.0, np.nan], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    neg = np.array([[2.0, 0.5], [0.5, np.nan], [2.0, 0.5], [0.5, 0.5], [0.5, 0.5]])
    scores = conflict_scores(pos, neg)
    np.testing.assert_array_equal(scores["sign_flips"], [0.75, 0.0])
    np.testing.assert_allclose(scores["total_mean"], [0.1, -0.5])
    np.testing.assert_allclose(scores["oscillation"], [0.54 / 0.01, 0.0])


def test_unused_dimensions_are_nan_and_survive_the_json_round_trip(tmp_path):
    u = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.6, 0.0], [0.8, 0.0]])
    rec = conflict_record(u, 0.2)
    assert rec["freq"].tolist() == [1.0, 0.0] and torch.isnan(rec["pos"][1])
    lines = [to_json(dict(step=s, **rec)) for s in (5, 10)]
    assert "NaN" not in lines[0] and json.loads(lines[0])["pos"][1] is None
    (tmp_path / "conflict.jsonl").write_text("\n".join(lines) + "\n")
    back = read_conflict(tmp_path)
    assert back["step"].tolist() == [5, 10] and back["pos"].shape == (2, 2) and np.isnan(back["neg"][0, 1])
    scores = conflict_scores(back["pos"], back["neg"])
    assert np.isnan(scores["sign_flips"][1]) and scores["sign_flips"][0] == 0
    assert read_conflict(tmp_path / "elsewhere") is None


@pytest.mark.parametrize("rec, expected", [
    (dict(active=0.3, gate_rate=0.6, kl=5.0), []),
    (dict(active=0.3, gate_rate=0.01, kl=5.0), ["closed"]),
    (dict(active=0.3, gate_rate=0.99, kl=5.0), ["open"]),
    (dict(active=0.3, gate_rate=0.8, kl=1e-4), ["KL collapse"]),
    (dict(active=0.0, gate_rate=0.6, kl=5.0), ["every feature"]),
    (dict(active=0.0, kl=0.0), ["every feature"]),  # NCL: no gates, no KL
    (dict(active=0.2, kl=0.0), []),
])
def test_degeneracy_warnings(rec, expected):
    found = degeneracy_warnings(rec, num_features=64)
    assert len(found) == len(expected) and all(e in f for e, f in zip(expected, found))


@pytest.mark.parametrize("kl_weight", [3e-5, 0.5])
def test_gate_pulls_split_the_gate_gradient_into_likelihood_and_prior(kl_weight):
    cfg = resolve(Config(dataset="digits", gate="ste", proj_hidden=32, proj_dim=16, kl_weight=kl_weight,
                         prior_prob=0.75))
    learner = ContrastiveLearner(cfg, in_channels=1, num_train=100)
    x = torch.randn(24, 1, 8, 8)
    loss, stats = learner(x)
    loss.backward()
    nce, prior = gate_pulls(stats.gates.grad, stats.probs, learner.model.prior.rate(), kl_weight,
                            0.01)
    assert learner.head.pulls(stats) == dict(gate_nce_pull=nce, gate_prior_pull=prior)
    # expected, from the plain formula: InfoNCE's gradient w.r.t. the 0/1 gates, and lambda * dKL/dalpha
    h = learner.backbone(x)
    z = learner.head.projector(h)
    alpha = learner.gate_probs(h).detach().requires_grad_()
    m = (alpha > 0.5).float().requires_grad_()
    nce_grad, = torch.autograd.grad(info_nce_rows(normalize(learner.model.features(z) * m), 0.2).sum(), m)
    kl_grad, = torch.autograd.grad(bernoulli_kl(alpha, 0.75, 0.01).sum(), alpha)
    assert nce == pytest.approx(nce_grad.abs().mean().item(), rel=1e-4)
    assert prior == pytest.approx(kl_weight * kl_grad.abs().mean().item(), rel=1e-4)
    assert (prior < nce / 100) == (kl_weight == 3e-5)
