import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from bayesncl_pyro.evaluate.probe import FAST_PROBE, REFERENCE_PROBES, knn_top1, linear_probe, train_linear


def blobs(num_classes, n, dim=16, spread=0.5, seed=0):
    """n x dim Gaussian blobs around fixed, well-separated class centres, and their labels."""
    generator = torch.Generator().manual_seed(seed)
    centres = 4 * torch.randn(num_classes, dim, generator=torch.Generator().manual_seed(123))
    labels = torch.arange(n) % num_classes
    return centres[labels] + spread * torch.randn(n, dim, generator=generator), labels


def test_linear_probe_separates_blobs_and_top5_is_one_for_few_classes():
    train_x, train_y = blobs(4, 400, seed=1)
    test_x, test_y = blobs(4, 200, seed=2)
    result = linear_probe(train_x, train_y, test_x, test_y, 4, dataclasses.replace(FAST_PROBE, epochs=10))
    assert result["top1"] > 0.95
    assert result["top5"] == 1.0


def test_linear_probe_is_deterministic_and_scale_free():
    train_x, train_y = blobs(8, 320, spread=4.0, seed=1)
    test_x, test_y = blobs(8, 160, spread=4.0, seed=2)
    recipe = dataclasses.replace(FAST_PROBE, epochs=5)
    def run(scale):
        return linear_probe(scale * train_x, train_y, scale * test_x, test_y, 8, recipe, seed=3)

    first = run(1.0)
    assert run(1.0) == first
    # Standardisation makes a 1000x feature scale irrelevant, so one default lr fits every backbone.
    assert run(1000.0) == pytest.approx(first, abs=1 / 160)


def plain_reference_probe(x, y, num_classes, seed, lars):
    """The reference's linear evaluation written out: torch's nn.Linear initialisation, raw features, batches of
    256 with the last incomplete one dropped, 50 epochs; CIFAR: LARS (trust ratio eta 0.02 clipped at the lr,
    weight decay 1e-4, on the weight only; momentum 0.9), lr 0.4 warmed up over 10 epochs from 3e-5, then cosine
    to 0, per batch; ImageNet-100: SGD, momentum 0.9, lr 1.0 throughout."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        init = torch.nn.Linear(x.shape[1], num_classes)
    weight, bias = init.weight.detach().clone(), init.bias.detach().clone()
    moment_w, moment_b = torch.zeros_like(weight), torch.zeros_like(bias)
    order_rng = torch.Generator().manual_seed(seed)
    per_epoch = len(x) // 256
    total, warmup, base = 50 * per_epoch, 10 * per_epoch, 0.4 if lars else 1.0
    step = 0
    for _ in range(50):
        order = torch.randperm(len(x), generator=order_rng)
        for i in range(per_epoch):
            rows = order[256 * i:256 * (i + 1)]
            if not lars:
                lr = base
            elif step < warmup:
                lr = 3e-5 + (base - 3e-5) * step / warmup
            else:
                lr = 0.5 * base * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
            weight.requires_grad_(True)
            bias.requires_grad_(True)
            loss = F.cross_entropy(x[rows] @ weight.T + bias, y[rows])
            grad_w, grad_b = torch.autograd.grad(loss, (weight, bias))
            weight, bias = weight.detach(), bias.detach()
            if lars:
                w_norm = weight.norm()
                trust = min(float(0.02 * w_norm / (grad_w.norm() + 1e-4 * w_norm + 1e-8)) / lr, 1.0)
                grad_w = (grad_w + 1e-4 * weight) * trust
            moment_w = grad_w if step == 0 else 0.9 * moment_w + grad_w
            moment_b = grad_b if step == 0 else 0.9 * moment_b + grad_b
            weight, bias = weight - lr * moment_w, bias - lr * moment_b
            step += 1
    return weight, bias


@pytest.mark.parametrize("dataset", ["cifar100", "in100"])
def test_the_reference_probe_matches_its_formula_written_out(dataset):
    # 600 rows: 2 full batches of 256 per epoch and a dropped remainder; raw features of a large scale
    x, y = blobs(5, 600, dim=12, spread=3.0, seed=1)
    x = x.abs()  # raw: non-negative and far from standardised, like ReLU backbone features
    head = train_linear(x, y, 5, REFERENCE_PROBES[dataset], seed=4)
    weight, bias = plain_reference_probe(x, y, 5, seed=4, lars=dataset == "cifar100")
    torch.testing.assert_close(head.weight.detach(), weight, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(head.bias.detach(), bias, rtol=1e-4, atol=1e-5)


def test_the_reference_probe_sees_raw_features_and_leaves_the_global_rng_alone():
    train_x, train_y = blobs(4, 300, seed=1)
    test_x, test_y = blobs(4, 100, seed=2)
    state = torch.get_rng_state()
    first = linear_probe(train_x, train_y, test_x, test_y, 4, REFERENCE_PROBES["cifar10"], seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    assert first == linear_probe(train_x, train_y, test_x, test_y, 4, REFERENCE_PROBES["cifar10"], seed=0)
    assert first["top1"] > 0.95
    # unlike the fast probe, no standardisation: the features' scale reaches the optimizer
    recipe = dataclasses.replace(REFERENCE_PROBES["in100"], epochs=2)
    small = train_linear(1e-3 * train_x, train_y, 4, recipe).weight
    large = train_linear(train_x, train_y, 4, recipe).weight
    assert not torch.allclose(small, large)


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
