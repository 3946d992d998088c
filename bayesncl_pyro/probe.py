"""Frozen-feature evaluation: a linear probe and a weighted kNN classifier on precomputed features.

Both take feature tensors (train: N x D, test: M x D) and long label tensors (N, M), never a
backbone, so they are cheap to rerun and to test. Accuracies are fractions, not percent.
"""

import math

import torch
import torch.nn.functional as F

_CHUNK_ROWS = 1024
"""Test rows per similarity block in kNN: 1024 x 50,000 floats is 200 MB."""


def linear_probe(train_x, train_y, test_x, test_y, num_classes, *, epochs=50, batch_size=256,
                 lr=0.1, weight_decay=0.0, seed=0):
    """Train Linear(D, C) on frozen features; return {"top1": float, "top5": float} on the test set.

    Features are standardised with the train mean and std, so one learning rate works for every
    backbone (the reference tunes lr per dataset: LARS 0.4 on CIFAR, SGD 1.0 on IN-100, for raw
    features of different scales); on standardised synthetic 100-class features lr 0.03-0.3 agreed
    within 3 points, so the default 0.1 sits mid-range. SGD with momentum 0.9 and a per-step cosine schedule,
    cross-entropy. Weights start at zero (the loss is convex, so no random init is needed) and
    ``seed`` drives the only randomness, the batch order, through a private generator: the result
    is deterministic and leaves the global RNG alone. top5 is top-min(5, C).
    """
    mean = train_x.float().mean(dim=0)
    std = train_x.float().std(dim=0).clamp_min(1e-6)  # constant dims would otherwise divide by 0
    train_x = (train_x.float() - mean) / std
    test_x = (test_x.float() - mean) / std

    weight = torch.zeros(train_x.shape[1], num_classes, requires_grad=True)
    bias = torch.zeros(num_classes, requires_grad=True)
    optimizer = torch.optim.SGD([weight, bias], lr=lr, momentum=0.9, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(seed)
    steps_per_epoch = math.ceil(len(train_x) / batch_size)
    total_steps = epochs * steps_per_epoch

    for epoch in range(epochs):
        order = torch.randperm(len(train_x), generator=generator)
        for i, batch in enumerate(order.split(batch_size)):
            step = epoch * steps_per_epoch + i
            optimizer.param_groups[0]["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / total_steps))
            loss = F.cross_entropy(train_x[batch] @ weight + bias, train_y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    with torch.no_grad():
        top = (test_x @ weight + bias).topk(min(5, num_classes), dim=1).indices
    hits = top == test_y[:, None]
    return {"top1": float(hits[:, 0].float().mean()), "top5": float(hits.any(dim=1).float().mean())}


def knn_top1(train_x, train_y, test_x, test_y, *, k=20, temperature=0.07):
    """Top-1 accuracy of weighted kNN on L2-normalised features (InstDisc / solo-learn weighting).

    Each test row's k most cosine-similar train rows vote for their class with weight
    exp(similarity / temperature); the class with the largest summed vote wins.
    """
    train_x = F.normalize(train_x.float(), dim=1)
    test_x = F.normalize(test_x.float(), dim=1)
    num_classes = int(max(train_y.max(), test_y.max())) + 1
    k = min(k, len(train_x))

    correct = 0
    for rows in torch.arange(len(test_x)).split(_CHUNK_ROWS):
        sims, neighbours = (test_x[rows] @ train_x.T).topk(k, dim=1)
        votes = torch.zeros(len(rows), num_classes).scatter_add_(
            1, train_y[neighbours], (sims / temperature).exp())
        correct += int((votes.argmax(dim=1) == test_y[rows]).sum())
    return correct / len(test_x)
