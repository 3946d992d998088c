"""A training set held on the training device as one uint8 tensor, when its images are small and of one size."""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision.transforms.v2.functional import pil_to_tensor

from bayesncl_pyro.data.images import TensorImages, image_files

RESIDENT_MEMORY_SHARE = 0.25
"""The most of the training device's free memory a training set may take to be held there (``resident_images``)."""


def resident_images(dataset: Dataset, device: torch.device, workers: int = 0) -> torch.Tensor | None:
    """The training split as one uint8 tensor on ``device``, or None when it should be read per batch.

    ``N x C x H x W``, row i = item i. None when its images differ in size, or they would take more than
    ``RESIDENT_MEMORY_SHARE`` of the device's free memory (``free_memory``).

    In-memory splits (digits, CIFAR pickles, compositional) are copied over. Image files are decoded once,
    here, with PIL in ``workers`` DataLoader processes (the worker path's reader: the same pixels, and
    ``skip_bad`` replaces an unreadable file by the next readable one alike); the size of the first image
    decides whether that is tried at all, so an ImageNet folder costs one file read, and the first batch whose
    images differ ends it. The decoded batches fill one tensor allocated on ``device`` up front: the host holds
    the batches in flight, never the set. Nothing is decoded per step, nvJPEG included.
    """
    base = dataset.dataset if isinstance(dataset, Subset) else dataset
    indices = dataset.indices if isinstance(dataset, Subset) else None
    budget = RESIDENT_MEMORY_SHARE * free_memory(device)
    if isinstance(base, TensorImages):
        images = base.images if indices is None else base.images[indices]
        return images.to(device) if images.numel() <= budget else None
    files = image_files(dataset)
    if files is None or not len(dataset):
        return None
    first = _PixelTensors(dataset)[0]
    if first.numel() * len(dataset) > budget:
        return None
    loader = DataLoader(_PixelTensors(dataset), batch_size=256, num_workers=workers,
                        collate_fn=_StackIfEqual(first.shape))
    images = torch.empty(len(dataset), *first.shape, dtype=torch.uint8, device=device)
    start = 0
    for batch in loader:
        if batch is None:
            return None
        images[start:start + len(batch)].copy_(batch)  # blocking: the batch's memory is reused right after
        start += len(batch)
    return images


class _StackIfEqual:
    """Collate images of ``shape`` into one tensor (one shared-memory block per batch), or None if any differs."""

    def __init__(self, shape: torch.Size):
        self.shape = shape

    def __call__(self, images: list[torch.Tensor]) -> torch.Tensor | None:
        return torch.stack(images) if all(image.shape == self.shape for image in images) else None


class _PixelTensors(Dataset):
    """Item i of an image-file split as uint8 ``3 x H x W``, read as the worker path reads it."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> torch.Tensor:
        return pil_to_tensor(self.dataset[i][0])


def free_memory(device: torch.device) -> int:
    """Bytes free on ``device``: the GPU's free memory, or the host's available memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

