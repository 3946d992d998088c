"""The generated "blue sky" benchmark: shapes on shared textured backgrounds, and novel images from the same generator.

The shapes are the classes, the backgrounds are shared by every class; both factors are recorded per image. Nothing to
download; deterministic given the seed. :func:`novel_sets` draws images the training split never showed, by the same
generator: new shapes (semantic novelty), and seen shapes on a new texture or in new colours (nuisance shifts, which a
score that follows the class should not flag); ``holdout`` cells of :func:`load_compositional` give the fourth kind,
seen shapes and backgrounds in a combination never trained on.
"""

from __future__ import annotations

import numpy as np
import torch

from bayesncl_pyro.data.images import DataSpec, TensorImages
from bayesncl_pyro.errors import UserError

SHAPES = ("disk", "square", "triangle", "ring", "plus", "diamond", "bars", "checker")
"""The classes of the compositional benchmark: the foreground shape (its colour, size and place are random)."""

BACKGROUNDS = ("sky", "grass", "sand", "wall")
"""Its nuisance factor: a textured background shared by every class, independent of the class."""

COMPOSITIONAL_SIZES = dict(train=125, test=40)
"""Images per (shape, background) cell of each split: 4000 train and 1280 test images."""

_BG_COLORS = np.array([[(0.35, 0.6, 0.95), (0.85, 0.92, 1.0)], [(0.15, 0.45, 0.1), (0.35, 0.7, 0.2)],
                       [(0.85, 0.7, 0.4), (0.95, 0.85, 0.6)], [(0.45, 0.45, 0.45), (0.7, 0.7, 0.7)]])


def load_compositional(seed: int, size: int = 32, holdout: tuple[tuple[str, str], ...] = ()) -> DataSpec:
    """The generated "blue sky" benchmark: one of ``SHAPES`` (the class) drawn on one of ``BACKGROUNDS``.

    Every (shape, background) pair has ``COMPOSITIONAL_SIZES[split]`` images, so the background says
    nothing about the class. Both factors are recorded per image in ``dataset.factors``
    (``{"class": N, "background": N}`` long tensors). Deterministic given ``seed``.

    ``holdout``: (shape, background) cells (:func:`parse_cells`) left out of both splits; their test images are the
    novel set ``unseen-combinations`` (``DataSpec.novel``, beside :func:`novel_sets`). The other images are those of
    the full benchmark, drawn in the same order, so the remaining cells' images are the same with or without a
    holdout.
    """
    cells = {(SHAPES.index(s), BACKGROUNDS.index(b)) for s, b in holdout}
    train, test = (_compositional_split(np.random.default_rng([seed, i]), n, size)
                   for i, n in enumerate(COMPOSITIONAL_SIZES.values()))
    unseen = {}
    if cells:
        held = [_in_cells(split, cells) for split in (train, test)]
        unseen = {"unseen-combinations": _subset(test, held[1])}
        train, test = (_subset(split, ~h) for split, h in zip((train, test), held))
    return DataSpec(train, test, classes=list(SHAPES), channels=3,
                    novel_sets=lambda: {**unseen, **novel_sets(seed, size)})


def parse_cells(text: str | None) -> tuple[tuple[str, str], ...]:
    """``"disk:sky,ring:grass"`` -> ``(("disk", "sky"), ("ring", "grass"))``: (shape, background) cells, checked."""
    if not text:
        return ()
    cells = []
    for item in text.split(","):
        shape, _, background = item.strip().partition(":")
        if shape not in SHAPES or background not in BACKGROUNDS:
            raise UserError(f"--holdout-cells takes shape:background pairs separated by commas (shapes: "
                            f"{', '.join(SHAPES)}; backgrounds: {', '.join(BACKGROUNDS)}), got {item.strip()!r}")
        cells.append((shape, background))
    held = set(cells)
    for shape in SHAPES:
        if all((shape, b) in held for b in BACKGROUNDS):
            raise UserError(f"--holdout-cells holds out every background of {shape!r}: it would be a class never "
                            "trained on (a new shape: the novel set new-shapes already is one); keep one of its cells")
    return tuple(dict.fromkeys(cells))


NOVEL_SHAPES = ("star", "crescent", "hourglass")
"""Shapes never drawn in training: the semantic novel set ``new-shapes``."""

NOVEL_SET_SIZE = 640
"""Images per generated novel set (the test split has 1280 in-distribution images)."""

_NOVEL_BG_COLORS = np.array([[(0.75, 0.1, 0.2), (1.0, 0.55, 0.65)], [(0.45, 0.1, 0.55), (0.8, 0.5, 0.95)],
                             [(0.05, 0.45, 0.45), (0.3, 0.9, 0.85)], [(0.55, 0.3, 0.05), (0.95, 0.6, 0.1)]])
"""The ``new-colours`` set's palettes, one per background texture: hues no training background has (red, purple,
teal, orange). Training's shape colours already fill the RGB cube (uniform per image), so the colour shift is on the
backgrounds."""

NOVEL_KINDS = {"new-shapes": "semantic", "unseen-combinations": "semantic", "new-texture": "nuisance",
               "new-colours": "nuisance"}
"""Each novel set's kind: semantic (a class or combination never trained on: to be flagged) or nuisance (seen
shapes under a shift the class does not depend on: a score that follows the class stays quiet)."""


def novel_sets(seed: int, size: int = 32) -> dict[str, TensorImages]:
    """The generated novel sets, ``NOVEL_SET_SIZE`` images each, deterministic given ``seed``.

    * ``new-shapes``: one of ``NOVEL_SHAPES`` on one of the seen ``BACKGROUNDS`` (label -1: no class);
    * ``new-texture``: a seen shape on a texture no training image has (concentric rings), in a seen palette;
    * ``new-colours``: a seen shape on a seen texture in a palette no training image has (``_NOVEL_BG_COLORS``).

    Their random streams are the seed's, apart from the splits': they never repeat a training image's draws.
    """
    n_bg, n_shapes = len(BACKGROUNDS), len(SHAPES)
    plans = {
        "new-shapes": lambda i: (n_shapes + i % len(NOVEL_SHAPES), (i // len(NOVEL_SHAPES)) % n_bg, None),
        "new-texture": lambda i: (i % n_shapes, n_bg, (i // n_shapes) % n_bg),
        "new-colours": lambda i: (i % n_shapes, (i // n_shapes) % n_bg, "novel"),
    }
    sets = {}
    for j, (name, plan) in enumerate(plans.items()):
        rng = np.random.default_rng([seed, 100 + j])
        cells = [plan(i) for i in rng.permutation(NOVEL_SET_SIZE)]
        images = np.stack([_compose(rng, s, b, size, palette=p) for s, b, p in cells])
        shape = torch.tensor([s if s < n_shapes else -1 for s, _, _ in cells])
        background = torch.tensor([b for _, b, _ in cells])
        sets[name] = TensorImages(_to_uint8(images), shape.tolist(), factors={"class": shape, "background": background})
    return sets


def _in_cells(split: TensorImages, cells: set[tuple[int, int]]) -> torch.Tensor:
    pairs = zip(split.factors["class"].tolist(), split.factors["background"].tolist())
    return torch.tensor([pair in cells for pair in pairs])


def _subset(split: TensorImages, keep: torch.Tensor) -> TensorImages:
    return TensorImages(split.images[keep], [y for y, k in zip(split.labels, keep.tolist()) if k],
                        factors={k: v[keep] for k, v in split.factors.items()})


def _to_uint8(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.round(images * 255).astype(np.uint8)).permute(0, 3, 1, 2).contiguous()


def _compositional_split(rng: np.random.Generator, per_cell: int, size: int) -> TensorImages:
    cells = [(c, b) for c in range(len(SHAPES)) for b in range(len(BACKGROUNDS))] * per_cell
    cells = [cells[i] for i in rng.permutation(len(cells))]
    images = np.stack([_compose(rng, c, b, size) for c, b in cells])
    shape, background = torch.tensor(cells).T
    return TensorImages(_to_uint8(images), shape.tolist(), factors={"class": shape, "background": background})


def _compose(rng: np.random.Generator, shape: int, background: int, size: int, palette=None) -> np.ndarray:
    """One ``size x size x 3`` float image in [0, 1].

    ``shape`` indexes ``SHAPES`` then ``NOVEL_SHAPES``; ``background`` indexes ``BACKGROUNDS``, then the novel
    texture (index ``len(BACKGROUNDS)``, drawn in the palette of background ``palette``); ``palette="novel"`` draws
    a seen texture in ``_NOVEL_BG_COLORS``. The draws of a training image are those of the benchmark as first
    published (the novel branches draw after them, or in their place).
    """
    y, x = np.mgrid[0:size, 0:size] / size
    phase = rng.uniform(0, 2 * np.pi)
    # each background: a two-colour blend driven by its own texture
    if background < len(BACKGROUNDS):
        texture = [y, 0.5 + 0.5 * np.sin(40 * y + phase), rng.uniform(size=(size, size)),
                   0.5 + 0.5 * np.sign(np.sin(25 * (x + y) + phase))][background]
        colors = _NOVEL_BG_COLORS[background] if palette == "novel" else _BG_COLORS[background]
    else:  # the novel texture: concentric rings about a random centre
        cy0, cx0 = rng.uniform(0, 1, size=2)
        texture = 0.5 + 0.5 * np.sin(30 * np.hypot(y - cy0, x - cx0) + phase)
        colors = _BG_COLORS[palette]
    low, high = colors * rng.uniform(0.85, 1.15)
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
        # NOVEL_SHAPES: a five-pointed star, a crescent, two triangles tip to tip
        dist <= 0.55 + 0.45 * np.cos(5 * np.arctan2(dy, dx)) ** 8,
        (dist <= 1) & (np.hypot(dx - 0.45, dy + 0.2) > 0.75),
        (box <= 0.9) & (abs(dx) <= abs(dy) + 0.05),
    ][shape]


