import math

import pytest
import torch

from bayesncl_pyro.probe import knn_top1, linear_probe


def blobs(num_classes, n, dim=16, spread=0.5, seed=0):
    """n x dim Gaussian blobs around fixed, well-separated class centres, and their labels."""
    generator = torch.Generator().manual_seed(seed)
    centres = 4 * torch.randn(num_classes, dim, generator=torch.Generator().manual_seed(123))
    labels = torch.arange(n) % num_classes
    return centres[labels] + spread * torch.randn(n, dim, generator=generator), labels


def test_linear_probe_separates_blobs_and_top5_is_one_for_few_classes():
    train_x, train_y = blobs(4, 400, seed=1)
    test_x, test_y = blobs(4, 200, seed=2)
    result = linear_probe(train_x, train_y, test_x, test_y, 4, epochs=10)
    assert result["top1"] > 0.95
    assert result["top5"] == 1.0


def test_linear_probe_is_deterministic_and_scale_free():
    train_x, train_y = blobs(8, 320, spread=4.0, seed=1)
    test_x, test_y = blobs(8, 160, spread=4.0, seed=2)
    run = lambda scale: linear_probe(scale * train_x, train_y, scale * test_x, test_y, 8, epochs=5, seed=3)
    first = run(1.0)
    assert run(1.0) == first
    # Standardisation makes a 1000x feature scale irrelevant, so one default lr fits every backbone.
    assert run(1000.0) == pytest.approx(first, abs=1 / 160)


def test_knn_on_separated_clusters_is_perfect():
    train_x, train_y = blobs(5, 200, seed=1)
    test_x, test_y = blobs(5, 100, seed=2)
    assert knn_top1(train_x, train_y, test_x, test_y) == 1.0


def test_knn_hand_case_k1():
    train_x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    train_y = torch.tensor([0, 1])
    test_x = torch.tensor([[0.9, 0.1], [0.2, 0.8], [3.0, 1.0]])
    # Nearest train points: 0, 1, 0 -> predictions 0, 1, 0; one of three labels is wrong.
    assert knn_top1(train_x, train_y, test_x, torch.tensor([0, 0, 0]), k=1) == pytest.approx(2 / 3)


def test_knn_weights_votes_by_exp_similarity_over_temperature():
    # One class-0 neighbour at cosine 1, two class-1 neighbours at cosine 1/2.
    a = math.radians(60)
    train_x = torch.tensor([[1.0, 0.0], [math.cos(a), math.sin(a)], [math.cos(a), -math.sin(a)]])
    train_y = torch.tensor([0, 1, 1])
    test_x, test_y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    # T = 0.07: e^(1/0.07) > 2 e^(0.5/0.07), class 0 wins. T = 1: e < 2 e^0.5, class 1 wins.
    assert knn_top1(train_x, train_y, test_x, test_y, k=3, temperature=0.07) == 1.0
    assert knn_top1(train_x, train_y, test_x, test_y, k=3, temperature=1.0) == 0.0
