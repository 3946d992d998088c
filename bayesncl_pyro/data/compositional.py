"""The generated "blue sky" benchmark: shapes on shared textured backgrounds.

The shapes are the classes, the backgrounds are shared by every class; both factors are recorded per image. Nothing to
download; deterministic given the seed.
"""

from __future__ import annotations

import numpy as np
import torch

from bayesncl_pyro.data.images import DataSpec, TensorImages

SHAPES = ("disk", "square", "triangle", "ring", "plus", "diamond", "bars", "checker")
"""The classes of the compositional benchmark: the foreground shape (its colour, size and place are random)."""

BACKGROUNDS = ("sky", "grass", "sand", "wall")
"""Its nuisance factor: a textured background shared by every class, independent of the class."""

COMPOSITIONAL_SIZES = dict(train=125, test=40)
"""Images per (shape, background) cell of each split: 4000 train and 1280 test images."""

_BG_COLORS = np.array([[(0.35, 0.6, 0.95), (0.85, 0.92, 1.0)], [(0.15, 0.45, 0.1), (0.35, 0.7, 0.2)],
                       [(0.85, 0.7, 0.4), (0.95, 0.85, 0.6)], [(0.45, 0.45, 0.45), (0.7, 0.7, 0.7)]])


def load_compositional(seed: int, size: int = 32) -> DataSpec:
    """The generated "blue sky" benchmark: one of ``SHAPES`` (the class) drawn on one of ``BACKGROUNDS``.

    Every (shape, background) pair has ``COMPOSITIONAL_SIZES[split]`` images, so the background says
    nothing about the class. Both factors are recorded per image in ``dataset.factors``
    (``{"class": N, "background": N}`` long tensors). Deterministic given ``seed``.
    """
    splits = [_compositional_split(np.random.default_rng([seed, i]), n, size)
              for i, n in enumerate(COMPOSITIONAL_SIZES.values())]
    return DataSpec(*splits, classes=list(SHAPES), channels=3)


def _compositional_split(rng: np.random.Generator, per_cell: int, size: int) -> TensorImages:
    cells = [(c, b) for c in range(len(SHAPES)) for b in range(len(BACKGROUNDS))] * per_cell
    cells = [cells[i] for i in rng.permutation(len(cells))]
    images = np.stack([_compose(rng, c, b, size) for c, b in cells])
    images = torch.from_numpy(np.round(images * 255).astype(np.uint8)).permute(0, 3, 1, 2).contiguous()
    shape, background = torch.tensor(cells).T
    return TensorImages(images, shape.tolist(), factors={"class": shape, "background": background})


def _compose(rng: np.random.Generator, shape: int, background: int, size: int) -> np.ndarray:
    """One ``size x size x 3`` float image in [0, 1]."""
    y, x = np.mgrid[0:size, 0:size] / size
    phase = rng.uniform(0, 2 * np.pi)
    # each background: a two-colour blend driven by its own texture
    texture = [y, 0.5 + 0.5 * np.sin(40 * y + phase), rng.uniform(size=(size, size)),
               0.5 + 0.5 * np.sign(np.sin(25 * (x + y) + phase))][background]
    low, high = _BG_COLORS[background] * rng.uniform(0.85, 1.15)
    image = low + (high - low) * texture[..., None]
    r = rng.uniform(0.22, 0.34) * size
    cy, cx = rng.uniform(r, size - r, size=2)
    dy, dx = (np.mgrid[0:size, 0:size] + 0.5 - np.array([cy, cx])[:, None, None]) / r
    mask = _shape_mask(shape, dx, dy)
    image[mask] = rng.uniform(0, 1, size=3)
    return np.clip(image + rng.normal(0, 0.03, size=image.shape), 0, 1)


def _shape_mask(shape: int, dx: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """Boolean mask of ``SHAPES[shape]`` on offsets ``dx, dy`` from its centre, in units of its radius."""
    dist, box = np.hypot(dx, dy), np.maximum(abs(dx), abs(dy))
    return [
        dist <= 1,
        box <= 0.8,
        (dy <= 0.8) & (abs(dx) <= (dy + 1) * 0.6),
        (dist <= 1) & (dist >= 0.55),
        ((abs(dx) <= 0.3) | (abs(dy) <= 0.3)) & (box <= 1),
        abs(dx) + abs(dy) <= 1,
        (box <= 0.9) & (np.floor((dy + 0.9) / 0.36) % 2 == 0),
        (box <= 0.9) & ((dx > 0) ^ (dy > 0)),
    ][shape]


