"""Frozen-feature evaluation: a linear probe and a weighted kNN classifier on precomputed features.

Both take feature tensors (train: N x D, test: M x D) and long label tensors (N, M), never a
backbone, so they are cheap to rerun and to test. Accuracies are fractions, not percent.

The linear probe is trained by one of the recipes below: ``FAST_PROBE`` for small runs, or the
reference's recipe for the dataset (``REFERENCE_PROBES``). docs/METHOD.md, "Evaluation protocols",
says where each setting comes from.
"""

import dataclasses

import torch
import torch.nn.functional as F

from bayesncl_pyro.loggers import Progress
from bayesncl_pyro.nn.optim import build_optimizer, warmup_cosine

_CHUNK_ROWS = 1024
"""Test rows per similarity block in kNN: 1024 x 50,000 floats is 200 MB."""


@dataclasses.dataclass(frozen=True)
class ProbeRecipe:
    """How a linear probe Linear(D, C) is trained on frozen features (cross-entropy, ``epochs`` passes)."""

    optimizer: str  # "sgd" or "lars" (bayesncl_pyro.nn.optim.LARS: trust ratio on the weight, not the bias)
    lr: float  # at batch 256; scaled by batch_size / 256, as the reference scales it
    momentum: float
    weight_decay: float
    warmup_epochs: float  # linear warm-up from optim.WARMUP_START_LR, then cosine to 0 ...
    cosine: bool  # ... or, when False, the lr held constant (after any warm-up)
    standardise: bool  # features shifted and scaled by the train mean and std; False: raw, as the reference
    zero_init: bool  # weights start at 0; False: torch's nn.Linear initialisation, drawn from ``seed``
    drop_last: bool  # skip each epoch's last, incomplete batch (the reference's loader does)
    epochs: int = 50
    batch_size: int = 256


FAST_PROBE = ProbeRecipe(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=0.0, warmup_epochs=0, cosine=True,
                         standardise=True, zero_init=True, drop_last=False)
"""One recipe for every backbone: standardised features make a single lr fit features of any scale (on
standardised synthetic 100-class features lr 0.03-0.3 agreed within 3 points, so 0.1 sits mid-range)."""

_REFERENCE_CIFAR = ProbeRecipe(optimizer="lars", lr=0.4, momentum=0.9, weight_decay=1e-4, warmup_epochs=10,
                               cosine=True, standardise=False, zero_init=False, drop_last=True)
_REFERENCE_IN100 = ProbeRecipe(optimizer="sgd", lr=1.0, momentum=0.9, weight_decay=0.0, warmup_epochs=0,
                               cosine=False, standardise=False, zero_init=False, drop_last=True)
REFERENCE_PROBES = {"cifar10": _REFERENCE_CIFAR, "cifar100": _REFERENCE_CIFAR, "in100": _REFERENCE_IN100}
"""The reference's linear-evaluation recipe per dataset: raw features, CIFAR LARS lr 0.4 with 10 warm-up
epochs and cosine, ImageNet-100 SGD lr 1.0 held constant (its decay milestones, epochs 60 and 80, lie past the
50 epochs trained)."""


def train_linear(train_x, train_y, num_classes, recipe: ProbeRecipe = FAST_PROBE, *, seed=0,
                 progress: Progress | None = None) -> torch.nn.Linear:
    """Linear(D, C) trained on frozen features (N x D) by ``recipe``: cross-entropy, the lr set every batch.

    ``seed`` drives all the randomness (the batch order and, unless ``recipe.zero_init``, the initial
    weights) through private generators: the result is deterministic and leaves the global RNG alone.
    With ``recipe.standardise`` the returned layer expects standardised inputs (``standardised``).
    ``progress`` (``progress.reporter``) shows the epochs go by.
    """
    train_x = train_x.float()
    if recipe.standardise:
        train_x = standardised(train_x, train_x)
    with torch.random.fork_rng(devices=[]):  # torch's initialisation, drawn from the seed alone
        torch.manual_seed(seed)
        head = torch.nn.Linear(train_x.shape[1], num_classes)
    if recipe.zero_init:  # the loss is convex: no random start is needed
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
    lr = recipe.lr * recipe.batch_size / 256
    optimizer = build_optimizer(recipe.optimizer, [dict(params=list(head.parameters()), lr=lr)], recipe.momentum,
                                recipe.weight_decay)

    generator = torch.Generator().manual_seed(seed)
    full, rest = divmod(len(train_x), recipe.batch_size)
    steps_per_epoch = full if recipe.drop_last and full else full + (rest > 0)
    total_steps = recipe.epochs * steps_per_epoch
    warmup_steps = round(recipe.warmup_epochs * steps_per_epoch)
    step = 0
    epochs = range(recipe.epochs)
    for _ in epochs if progress is None else progress(epochs, recipe.epochs, "linear probe", "epoch"):
        order = torch.randperm(len(train_x), generator=generator)
        for batch in order.split(recipe.batch_size)[:steps_per_epoch]:
            scheduled = recipe.cosine or step < warmup_steps
            optimizer.param_groups[0]["lr"] = lr * (warmup_cosine(step, warmup_steps, total_steps, lr)
                                                    if scheduled else 1.0)
            loss = F.cross_entropy(head(train_x[batch]), train_y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
    return head


def linear_probe(train_x, train_y, test_x, test_y, num_classes, recipe: ProbeRecipe = FAST_PROBE, *, seed=0,
                 progress: Progress | None = None):
    """Train a linear probe on frozen features and return its test accuracy.

    Linear(D, C), trained by ``recipe`` (``train_linear``); returns {"top1": float, "top5": float} on the test features.
    top5 is top-min(5, C).
    """
    head = train_linear(train_x, train_y, num_classes, recipe, seed=seed, progress=progress)
    test_x = test_x.float()
    if recipe.standardise:
        test_x = standardised(test_x, train_x.float())
    with torch.no_grad():
        top = head(test_x).topk(min(5, num_classes), dim=1).indices
    hits = top == test_y[:, None]
    return {"top1": float(hits[:, 0].float().mean()), "top5": float(hits.any(dim=1).float().mean())}


def standardised(x, train_x):
    """X shifted and scaled by the mean and std of the train features."""
    std = train_x.std(dim=0).clamp_min(1e-6)  # constant dims would otherwise divide by 0
    return (x - train_x.mean(dim=0)) / std


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
