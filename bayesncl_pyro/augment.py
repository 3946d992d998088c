"""SimCLR augmentations and the two-view dataset wrapper.

Built on ``torchvision.transforms.v2`` so one pipeline takes both PIL images (image files) and
uint8 ``C x H x W`` tensors (digits, CIFAR pickles), and always returns a normalised float tensor
``C x S x S``. Randomness comes from torch's global RNG, so ``torch.manual_seed`` reproduces views
(per DataLoader worker, torch seeds each worker from the base seed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.data import Dataset
from torchvision.transforms import InterpolationMode, v2

from bayesncl_pyro.errors import UserError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# SimCLR's recipe for colour images (Chen et al. 2020), shared with device_augment.simclr_views
CROP_SCALE, CROP_RATIO = (0.08, 1.0), (3 / 4, 4 / 3)
JITTER, P_JITTER = (0.8, 0.8, 0.8, 0.2), 0.8  # brightness, contrast, saturation, hue
P_GRAY, P_BLUR, P_FLIP = 0.2, 0.5, 0.5
BLUR_SIGMA = (0.1, 2.0)


def simclr_transform(
    image_size: int, channels: int = 3, mean: Sequence[float] | None = None, std: Sequence[float] | None = None
) -> Callable:
    """SimCLR's training augmentation: image (PIL or uint8 ``C x H x W``) -> float ``C x S x S``.

    Reference recipe (Chen et al. 2020): random resized crop (scale 0.08-1, bicubic), colour
    jitter 0.8/0.8/0.8/0.2 with p=0.8, grayscale p=0.2, Gaussian blur p=0.5, horizontal flip.
    """
    if channels == 1:
        # 8x8 digits: an 8% crop is one or two pixels of stroke, and a flipped digit is another
        # symbol (or none), so crop gently, skip the flip, and only jitter what a gray image has.
        crop_scale = (0.5, 1.0)
        color = [v2.RandomApply([v2.ColorJitter(brightness=0.8, contrast=0.8)], p=0.8)]
        flip = []
    else:
        crop_scale = CROP_SCALE
        color = [
            v2.RandomApply([v2.ColorJitter(*JITTER)], p=P_JITTER),
            v2.RandomGrayscale(p=P_GRAY),
        ]
        flip = [v2.RandomHorizontalFlip(p=P_FLIP)]
    kernel = blur_kernel(image_size)
    blur = [] if kernel is None else [v2.RandomApply([v2.GaussianBlur(kernel, sigma=BLUR_SIGMA)], p=P_BLUR)]
    return v2.Compose([
        v2.ToImage(),
        v2.RandomResizedCrop(image_size, scale=crop_scale, ratio=CROP_RATIO, interpolation=InterpolationMode.BICUBIC,
                             antialias=True),
        *color,
        *blur,
        *flip,
        *_to_normalized_float(channels, mean, std),
    ])


def eval_transform(
    image_size: int, channels: int = 3, mean: Sequence[float] | None = None, std: Sequence[float] | None = None
) -> Callable:
    """Deterministic evaluation transform: image -> float ``C x S x S``.

    For ``S >= 64`` resize the shorter side to ``S / 0.875`` and centre-crop ``S`` (ImageNet's
    256 -> 224 convention); small images (digits, CIFAR) are already framed, so just resize.
    """
    if image_size >= 64:
        resize = [v2.Resize(round(image_size / 0.875), interpolation=InterpolationMode.BICUBIC, antialias=True),
                  v2.CenterCrop(image_size)]
    else:
        resize = [v2.Resize((image_size, image_size), interpolation=InterpolationMode.BICUBIC, antialias=True)]
    return v2.Compose([v2.ToImage(), *resize, *_to_normalized_float(channels, mean, std)])


def blur_kernel(image_size: int) -> int | None:
    """The Gaussian blur's kernel size: odd, about 10% of the image side, at least 3 (SimCLR's choice).

    None (no blur) at 32 px and below: the reference recipe blurs at every size, but there a blur with
    sigma up to 2 wipes out most of the image's detail.
    """
    return None if image_size <= 32 else max(3, image_size // 10 // 2 * 2 + 1)


def _to_normalized_float(channels: int, mean: Sequence[float] | None, std: Sequence[float] | None) -> list:
    default_mean, default_std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else ((0.5,) * channels, (0.5,) * channels)
    mean, std = tuple(mean or default_mean), tuple(std or default_std)
    if len(mean) != channels or len(std) != channels:
        raise UserError(f"normalisation mean/std need {channels} values each (got {len(mean)} and {len(std)}); "
                        "give one value per image channel")
    # ToPureTensor: downstream code gets a plain tensor, not torchvision's Image subclass.
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std), v2.ToPureTensor()]


class TwoViews(Dataset):
    """Item ``i`` of ``dataset`` as ``(view1, view2, label, i)``: two independent draws of ``transform``.

    Indices past ``len(dataset)`` encode the epoch, ``epoch * len + i`` (see ``EpochSampler``), and the
    views of item i in an epoch are drawn from an RNG seeded by ``(seed, epoch, i)``: the same views
    whatever the number of workers, and after a resume in the middle of an epoch.
    """

    def __init__(self, dataset: Dataset, transform: Callable, seed: int = 0):
        self.dataset = dataset
        self.transform = transform
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        i = index % len(self.dataset)
        image, label = self.dataset[i]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed * 1_000_003 + index)
            return self.transform(image), self.transform(image), label, i
