"""SimCLR views drawn image by image on the CPU, the evaluation transform and the two-view dataset.

The views are drawn in DataLoader workers.

Every transform takes both PIL images (image files) and uint8 ``C x H x W`` tensors (digits, CIFAR
pickles) and returns a normalised float tensor ``C x S x S``. Randomness comes from torch's global RNG,
so ``torch.manual_seed`` reproduces views (``TwoViews`` seeds it per item).

The colour training views (``SimCLRColour``, run per image in the DataLoader workers) use the ops of
``device_views`` on one image, in float from the crop on, not ``torchvision.transforms.v2``: at 224 px
torchvision's pipeline spent most of a worker's time in its Gaussian blur (a 23 x 23 convolution, slower still
for sigma 0.3-0.8, whose outer taps are subnormal floats) and in uint8 <-> float conversions around each op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import InterpolationMode, RandomResizedCrop, v2
from torchvision.transforms.v2.functional import pil_to_tensor

from bayesncl_pyro.data import device_views as D
from bayesncl_pyro.data.recipe import (
    BLUR_SIGMA,
    CROP_RATIO,
    CROP_SCALE,
    IMAGENET_MEAN,
    IMAGENET_STD,
    JITTER,
    P_BLUR,
    P_FLIP,
    P_GRAY,
    P_JITTER,
    blur_kernel,
    blur_taps,
)
from bayesncl_pyro.errors import UserError


def simclr_transform(
    image_size: int, channels: int = 3, mean: Sequence[float] | None = None, std: Sequence[float] | None = None
) -> Callable:
    """SimCLR's training augmentation: image (PIL or uint8 ``C x H x W``) -> float ``C x S x S``.

    Reference recipe (Chen et al. 2020): random resized crop (scale 0.08-1, bicubic), colour
    jitter 0.8/0.8/0.8/0.2 with p=0.8, grayscale p=0.2, Gaussian blur p=0.5, horizontal flip
    (``SimCLRColour``); for one-channel images (digits) a gentler variant in torchvision.
    """
    normalize = _to_normalized_float(channels, mean, std)  # checks mean and std
    if channels == 3:
        return SimCLRColour(image_size, normalize[1].mean, normalize[1].std)
    # 8x8 digits: an 8% crop is one or two pixels of stroke, and a flipped digit is another
    # symbol (or none), so crop gently, skip the flip, and only jitter what a gray image has.
    return v2.Compose([
        v2.ToImage(),
        v2.RandomResizedCrop(image_size, scale=(0.5, 1.0), ratio=CROP_RATIO, interpolation=InterpolationMode.BICUBIC,
                             antialias=True),
        v2.RandomApply([v2.ColorJitter(brightness=0.8, contrast=0.8)], p=0.8),
        *([] if blur_kernel(image_size) is None else
          [v2.RandomApply([v2.GaussianBlur(blur_kernel(image_size), sigma=BLUR_SIGMA)], p=P_BLUR)]),
        *normalize,
    ])


class SimCLRColour:
    """SimCLR's view of one colour image (PIL or uint8 ``3 x H x W``) -> normalised float ``3 x S x S``.

    The recipe of torchvision's ``RandomResizedCrop`` (bicubic, antialiased) -> ``RandomApply(ColorJitter)``
    (a random op order per view) -> ``RandomGrayscale`` -> ``RandomApply(GaussianBlur)`` -> ``RandomHorizontalFlip``
    -> ``Normalize``, with ``device_views``'s ops (each tested equal to torchvision's) on a batch of one,
    except the blur (``gaussian_blur``, faster for one image). As on the device path the image stays float
    in [0, 1] after the crop, where torchvision's uint8 path rounds after every op.
    """

    def __init__(self, size: int, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD):
        self.size, self.kernel = size, blur_kernel(size)
        self.mean, self.std = torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)
        b, c, s, h = JITTER  # torchvision's ranges of the brightness, contrast, saturation and hue factors
        self.low = torch.tensor([max(0, 1 - b), max(0, 1 - c), max(0, 1 - s), -h])
        self.high = torch.tensor([1 + b, 1 + c, 1 + s, h])

    def __call__(self, image: Image.Image | torch.Tensor) -> torch.Tensor:
        """One SimCLR view of an RGB image (PIL or uint8 ``3 x H x W``), normalised float ``3 x S x S``."""
        x = pil_to_tensor(image) if isinstance(image, Image.Image) else image
        if x.ndim != 3 or x.shape[0] != 3 or x.dtype != torch.uint8:
            raise UserError(f"a colour view needs an RGB image (PIL, or uint8 3 x H x W), got {x.dtype} "
                            f"{tuple(x.shape)}; convert it to RGB first")
        top, left, h, w = RandomResizedCrop.get_params(x, list(CROP_SCALE), list(CROP_RATIO))
        # uint8 in, uint8 out, as torchvision resizes uint8 images on a CPU: 3x faster than in float (and
        # Pillow's bicubic, a = -0.5, where float tensors get PyTorch's a = -0.75)
        x = F.interpolate(x[None, :, top:top + h, left:left + w], size=(self.size, self.size), mode="bicubic",
                          antialias=True).float().div_(255)  # 1 x 3 x S x S
        # every other draw at once: a coin per op, the four jitter factors, the blur's sigma, the jitter order
        coin = torch.rand(4).tolist()
        factors = self.low + (self.high - self.low) * torch.rand(4)
        sigma = BLUR_SIGMA[0] + (BLUR_SIGMA[1] - BLUR_SIGMA[0]) * torch.rand(()).item()
        order = torch.randperm(4).tolist()
        if coin[0] < P_JITTER:
            ops = (D.adjust_brightness, D.adjust_contrast, D.adjust_saturation, D.adjust_hue)
            for k in order:
                x = ops[k](x, factors[k:k + 1])
        if coin[1] < P_GRAY:
            x = D.grayscale(x).expand_as(x)
        if self.kernel is not None and coin[2] < P_BLUR:
            x = gaussian_blur(x, sigma, self.kernel)
        if coin[3] < P_FLIP:
            x = x.flip(-1)
        return (x[0] - self.mean) / self.std


def gaussian_blur(x: torch.Tensor, sigma: float, kernel_size: int) -> torch.Tensor:
    """Torchvision's ``gaussian_blur`` of float images, as two band-matrix products.

    Images ``... x H x W``; ``kernel_size`` taps of a Gaussian of std ``sigma``, reflected at the borders. The band
    matrices fold the reflection in (``device_views.band_matrices``); for one image on a CPU core, BLAS makes these
    products faster than separable grouped convolutions or torchvision's 2-D convolution.
    """
    taps = blur_taps(sigma, kernel_size)[None]
    return D.band_matrices(taps, x.shape[-2])[0] @ x @ D.band_matrices(taps, x.shape[-1])[0].T


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


def _to_normalized_float(channels: int, mean: Sequence[float] | None, std: Sequence[float] | None) -> list:
    default_mean, default_std = ((IMAGENET_MEAN, IMAGENET_STD) if channels == 3
                                 else ((0.5,) * channels, (0.5,) * channels))
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
            # the CPU generator alone: torch.manual_seed also queues a seed for CUDA and two other lazily
            # initialised backends, with a formatted stack each time (a millisecond per item)
            torch.default_generator.manual_seed(self.seed * 1_000_003 + index)
            return self.transform(image), self.transform(image), label, i


def collate_views(batch):
    """``TwoViews`` items (v1, v2, label, index) -> one tensor of 2B rows [view 1; view 2]."""
    v1, v2, _, _ = zip(*batch)
    return torch.cat([torch.stack(v1), torch.stack(v2)])
