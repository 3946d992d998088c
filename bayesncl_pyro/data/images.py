"""What a split holds, in memory or as files read lazily, and a dataset's two splits.

``TensorImages`` (in memory), ``ImageFiles`` (files read lazily) and ``DataSpec`` (a dataset's two splits).

Items are ``(image, label)`` with ``image`` either a PIL RGB image (image files) or a uint8 tensor
``C x H x W`` (digits, CIFAR pickles, the generated benchmark); the view makers accept both.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset, Subset

from bayesncl_pyro.errors import UserError
from bayesncl_pyro.rundir import append_line

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"})


@dataclass
class DataSpec:
    """A dataset's two splits plus what a model needs to know about its images."""

    train: Dataset  # items (image, label: int)
    test: Dataset  # the held-out split (test or val)
    classes: list[str]  # class names, index = label
    channels: int  # 1 for digits, else 3
    # images unlike the training split's (generated data), made when asked: :meth:`novel`
    novel_sets: Callable[[], dict[str, Dataset]] | None = None

    def novel(self) -> dict[str, Dataset]:
        """The novel sets by name (images unlike the training split's, that novelty scores are judged on); {} if none.

        Made at each call: generating them costs as much as a split, and only an evaluation reads them.
        """
        return self.novel_sets() if self.novel_sets is not None else {}

    @property
    def num_classes(self) -> int:
        """The number of classes."""
        return len(self.classes)


class TensorImages(Dataset):
    """In-memory images: ``images`` uint8 ``N x C x H x W``, ``labels`` ``N`` ints.

    ``factors`` (generated data only): the ground-truth generative factors, name -> ``N`` long tensor.
    """

    def __init__(self, images: torch.Tensor, labels: list[int], factors: dict[str, torch.Tensor] | None = None):
        assert images.dtype == torch.uint8 and images.ndim == 4 and len(images) == len(labels)
        assert all(len(v) == len(labels) for v in (factors or {}).values())
        self.images = images
        self.labels = [int(y) for y in labels]
        self.factors = factors

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], self.labels[i]


class ImageFiles(Dataset):
    """Image files on disk, opened lazily as RGB PIL images.

    ``samples`` is a list of ``(path, label)``. With ``skip_bad`` an unreadable file is replaced
    by the next readable one (a long run can survive a few corrupt files in a big dataset) and
    recorded in ``bad_files``; without it, it raises ``UserError`` naming the file. ``bad_files``
    is per process, so with DataLoader workers it only sees the main process's reads; set ``bad_log``
    to a file and every process appends each file it skips to it, one path per line.
    """

    def __init__(self, samples: list[tuple[Path, int]], skip_bad: bool = False):
        self.samples = samples
        self.skip_bad = skip_bad
        self.bad_files: list[str] = []
        self.bad_log: Path | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Image.Image, int]:
        image, label, _ = self.read(i, open_rgb)
        return image, label

    def read(self, i: int, opener: Callable[[Path], Any]) -> tuple[Any, int, int]:
        """Read file ``i`` with ``opener``, or with ``skip_bad`` the first readable file from ``i`` on.

        Returns ``(opener(path), label, j)``; with ``skip_bad``, j is the first file from i on (cyclically) that
        ``opener`` reads without a ``UserError``, the ones before it recorded as bad.
        """
        n = len(self.samples)
        if not -n <= i < n:
            raise IndexError(i)  # also ends plain `for item in dataset` iteration
        for j in range(i, i + n):
            path, label = self.samples[j % n]
            try:
                return opener(path), label, j % n
            except UserError:
                if not self.skip_bad:
                    raise
                if str(path) not in self.bad_files:
                    self.bad_files.append(str(path))
                    if self.bad_log is not None:  # as bytes: a name need not be UTF-8
                        append_line(os.fsencode(path), self.bad_log)
        raise UserError(f"none of the {n} images could be read (first bad file: {self.bad_files[0]}); "
                        "check the data folder")


def open_image(path: Path, advice: str = "") -> Image.Image:
    """The image at ``path``, decoded in full here, so that a truncated file fails now.

    The error names the path, and ``advice``, the caller's way out.
    """
    try:
        with Image.open(path) as image:
            image.load()
            return image
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise UserError(f"cannot read image {path} ({err}){advice}") from None


def open_rgb(path: Path) -> Image.Image:
    """The RGB image at ``path``; a bad file raises a ``UserError`` that says how to skip it."""
    image = open_image(path, "; delete or replace it, or skip such files with --skip-bad-images (skip_bad=True)")
    return image if image.mode == "RGB" else image.convert("RGB")  # convert() would copy an RGB image


def image_files(dataset: Dataset) -> ImageFiles | None:
    """The ``ImageFiles`` a split reads (through a ``train_subset``), or None for in-memory images."""
    files = dataset.dataset if isinstance(dataset, Subset) else dataset
    return files if isinstance(files, ImageFiles) else None
