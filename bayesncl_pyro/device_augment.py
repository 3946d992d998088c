"""SimCLR's augmentation of a whole batch at once, on the training device (``--augment device``).

The worker path (``augment.simclr_transform`` in DataLoader workers) decodes and augments one image at a
time on the CPU, which caps a 16-core GPU machine near 1000-1500 images/s at 224 px. Here the training
process gets the batch's decoded images (``data.EncodedImages.decode``: nvjpeg on CUDA) and draws both
views of every image with batched kernels: the recipe of ``simclr_transform`` for colour images
(the constants in ``augment.py``), with three differences:

- the images stay float in [0, 1] from the crop on (the worker path rounds to uint8 after each op);
- ColorJitter's four ops run in one random order per batch (torchvision draws an order per image);
- every random parameter is drawn on the CPU from the generator the caller passes (the Trainer seeds it
  by seed, step and rank): the views do not depend on the device, and drawing them never waits for the GPU.

Each op is a pure function of ``B x 3 x H x W`` float images and per-image parameter tensors of length B
(on the images' device), equal to torchvision's ``transforms.v2.functional`` op applied image by image
(``tests/test_device_augment.py``). Nothing here waits for the GPU: parameters cross to it with
``non_blocking`` copies (a blocking one would wait for the previous training step to finish).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bayesncl_pyro.augment import (BLUR_SIGMA, CROP_RATIO, CROP_SCALE, IMAGENET_MEAN, IMAGENET_STD, JITTER, P_BLUR,
                                   P_FLIP, P_GRAY, P_JITTER, blur_kernel)

_GRAY_WEIGHTS = (0.2989, 0.587, 0.114)  # torchvision's (ITU-R 601-2 luma)


def simclr_views(images: list[torch.Tensor], size: int, generator: torch.Generator) -> torch.Tensor:
    """Two SimCLR views of each of N uint8 ``3 x H_i x W_i`` images -> float ``2N x 3 x size x size``, the rows
    ``[view 1 of every image; view 2 of every image]``, normalised with the ImageNet mean and std."""
    n, device = 2 * len(images), images[0].device
    sizes = torch.tensor([image.shape[-2:] for image in images]).repeat(2, 1)
    x = resized_crop(images + images, crop_boxes(sizes, generator), size).div_(255).clamp_(0, 1)

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.empty(n).uniform_(low, high, generator=generator)

    def coin(p: float) -> torch.Tensor:
        return torch.rand(n, generator=generator) < p

    b, c, s, h = JITTER
    factors = (uniform(max(0, 1 - b), 1 + b), uniform(max(0, 1 - c), 1 + c), uniform(max(0, 1 - s), 1 + s),
               uniform(-h, h))
    order = torch.randperm(4, generator=generator).tolist()

    def jitter(v, *f):
        for k in order:
            v = (adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue)[k](v, f[k])
        return v

    x = _apply_where(coin(P_JITTER), x, jitter, *factors)
    x = _apply_where(coin(P_GRAY), x, lambda v: grayscale(v).expand_as(v))
    kernel = blur_kernel(size)
    if kernel is not None:
        x = _apply_where(coin(P_BLUR), x, lambda v, sigma: gaussian_blur(v, sigma, kernel), uniform(*BLUR_SIGMA))
    x = _apply_where(coin(P_FLIP), x, lambda v: v.flip(-1))
    mean, std = (torch.tensor(m).view(3, 1, 1).to(device, non_blocking=True) for m in (IMAGENET_MEAN, IMAGENET_STD))
    return x.sub_(mean).div_(std)


def _apply_where(mask: torch.Tensor, x: torch.Tensor, op, *params: torch.Tensor) -> torch.Tensor:
    """``x`` with ``op(rows, *their params)`` in the rows that the CPU bool ``mask`` selects (``params``: CPU
    tensors of length B). Indexing by CPU-computed indices keeps the GPU from syncing and computes only
    the selected rows."""
    rows = mask.nonzero().squeeze(1)
    if len(rows):
        on = rows.to(x.device, non_blocking=True)
        x[on] = op(x[on], *(p[rows].to(x.device, non_blocking=True) for p in params))
    return x


# ---------------------------------------------------------------------------------------------- crop


def crop_boxes(sizes: torch.Tensor, generator: torch.Generator, scale=CROP_SCALE, ratio=CROP_RATIO,
               tries: int = 10) -> torch.Tensor:
    """RandomResizedCrop's boxes for images of ``sizes`` (``N x 2``: height, width) -> ``N x 4`` long
    (top, left, height, width), drawn as torchvision draws them, for all images at once: the first of
    ``tries`` (area, aspect) draws that fits the image, else the central crop of the clamped aspect."""
    n = len(sizes)
    height, width = sizes[:, :1].double(), sizes[:, 1:].double()  # N x 1
    area = height * width * torch.empty(n, tries, dtype=torch.double).uniform_(*scale, generator=generator)
    log_ratio = torch.empty(n, tries, dtype=torch.double).uniform_(*map(math.log, ratio), generator=generator)
    w = (area * log_ratio.exp()).sqrt().round()
    h = (area / log_ratio.exp()).sqrt().round()
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = fits.double().argmax(1, keepdim=True)  # the first try that fits (0 if none does)
    h, w = h.gather(1, first), w.gather(1, first)
    u = torch.rand(n, 2, dtype=torch.double, generator=generator)
    top, left = (u[:, :1] * (height - h + 1)).floor(), (u[:, 1:] * (width - w + 1)).floor()
    # no try fits: the whole image, cut to the nearest allowed aspect ratio, centred
    fw = torch.minimum(width, (height * ratio[1]).round())
    fh = torch.minimum(height, (width / ratio[0]).round())
    none = ~fits.any(1, keepdim=True)
    h, w = torch.where(none, fh, h), torch.where(none, fw, w)
    top = torch.where(none, ((height - fh) / 2).floor(), top)
    left = torch.where(none, ((width - fw) / 2).floor(), left)
    return torch.cat([top, left, h, w], 1).long()


def resized_crop(images: list[torch.Tensor], boxes: torch.Tensor, size: int) -> torch.Tensor:
    """Crop ``boxes[i]`` (top, left, height, width) of ``images[i]`` (``C x H_i x W_i``, any sizes) and resize
    it to ``size x size`` (bicubic, antialiased, like RandomResizedCrop) -> float ``N x C x size x size``.

    One interpolation per image: the images differ in size, and padding them to one tensor (for
    ``roi_align`` or a batched matrix product) would cost memory for the largest image in the batch
    (ImageNet has multi-megapixel outliers), and roi_align's bilinear sampling is not the recipe's
    antialiased bicubic resize. The per-image kernels queue behind the GPU's previous step.
    """
    return torch.cat([
        F.interpolate(image[None, :, t:t + h, l:l + w].float(), size=(size, size), mode="bicubic", antialias=True)
        for image, (t, l, h, w) in zip(images, boxes.tolist(), strict=True)])


# --------------------------------------------------------------------------------------------- colour


def _per_image(f: torch.Tensor) -> torch.Tensor:
    return f.view(-1, 1, 1, 1)


def _blend(x: torch.Tensor, other: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return (_per_image(f) * x + (1 - _per_image(f)) * other).clamp(0, 1)


def grayscale(x: torch.Tensor) -> torch.Tensor:
    """``B x 3 x H x W`` -> luma ``B x 1 x H x W``."""
    r, g, b = x.unbind(1)
    return (_GRAY_WEIGHTS[0] * r + _GRAY_WEIGHTS[1] * g + _GRAY_WEIGHTS[2] * b).unsqueeze(1)


def adjust_brightness(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return (x * _per_image(f)).clamp(0, 1)


def adjust_contrast(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Blend each image with its mean luma."""
    return _blend(x, grayscale(x).mean((1, 2, 3), keepdim=True), f)


def adjust_saturation(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Blend each image with its luma image."""
    return _blend(x, grayscale(x), f)


def adjust_hue(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Rotate each image's hue by ``f`` turns (in [-0.5, 0.5]), value and saturation kept (HSV hexcone)."""
    r, g, b = x.unbind(1)
    value, low = x.amax(1), x.amin(1)
    chroma = value - low
    safe = torch.where(chroma > 0, chroma, 1)
    # hue in sixths of a turn; ties go to red, then green, as in torchvision (and Pillow)
    hue = torch.where(value == r, (g - b) / safe, torch.where(value == g, 2 + (b - r) / safe, 4 + (r - g) / safe))
    hue = (hue / 6 + f.view(-1, 1, 1)) % 1 * 6
    # back to RGB: channel n (r, g, b = 5, 3, 1) is value - chroma * clamp(min(k, 4 - k), 0, 1), k = (n + hue) % 6
    k = (torch.arange(5, 0, -2, device=x.device, dtype=x.dtype).view(1, 3, 1, 1) + hue.unsqueeze(1)) % 6
    return value.unsqueeze(1) - chroma.unsqueeze(1) * torch.minimum(k, 4 - k).clamp(0, 1)


# ----------------------------------------------------------------------------------------------- blur


def gaussian_blur(x: torch.Tensor, sigma: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Blur image i with a ``kernel_size`` Gaussian of standard deviation ``sigma[i]`` (pixels), reflecting at
    the borders: two separable passes of a grouped convolution, one group per image and channel."""
    b, c, height, width = x.shape
    t = torch.arange(kernel_size, device=x.device, dtype=x.dtype) - (kernel_size - 1) / 2
    kernel = torch.softmax(-0.5 * (t / sigma.view(-1, 1)) ** 2, dim=1).repeat_interleave(c, 0)  # BC x k
    pad = kernel_size // 2
    y = F.pad(x, (pad, pad, pad, pad), mode="reflect").view(1, b * c, height + 2 * pad, width + 2 * pad)
    y = F.conv2d(y, kernel.view(b * c, 1, kernel_size, 1), groups=b * c)
    y = F.conv2d(y, kernel.view(b * c, 1, 1, kernel_size), groups=b * c)
    return y.view(b, c, height, width)
