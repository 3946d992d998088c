"""SimCLR's augmentation of a whole batch at once, on the training device (``--augment device``).

The worker path (``views.simclr_transform`` in DataLoader workers) decodes and augments one image at a
time on the CPU, which caps a 16-core GPU machine near 1000-1500 images/s at 224 px. Here the training
process gets the batch's decoded images (``decode.EncodedImages.decode``: nvjpeg on CUDA) and draws both
views of every image with batched kernels: the recipe of ``simclr_transform`` for colour images
(the constants in ``recipe.py``), with three differences:

- the images stay float in [0, 1] from the crop on (the worker path rounds to uint8 after each op);
- ColorJitter's four ops run in one random order per batch (torchvision draws an order per image);
- every random parameter is drawn on the CPU from the generator the caller passes (the Trainer seeds it
  by seed, step and rank): the views do not depend on the device, and drawing them never waits for the GPU.

Each op is a pure function of ``B x 3 x H x W`` float images and per-image parameter tensors of length B
(on the images' device), equal to torchvision's ``transforms.v2.functional`` op applied image by image
(``tests/test_device_views.py``). Nothing here waits for the GPU: a batch's parameters cross to it in one
``non_blocking`` copy from pinned memory. ``pipeline.py`` runs this on its own CUDA stream, a batch ahead
of the training step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bayesncl_pyro.data.recipe import (BLUR_SIGMA, CROP_RATIO, CROP_SCALE, IMAGENET_MEAN, IMAGENET_STD, JITTER, P_BLUR,
                                       P_FLIP, P_GRAY, P_JITTER, blur_kernel, blur_taps)

_GRAY_WEIGHTS = (0.2989, 0.587, 0.114)  # torchvision's (ITU-R 601-2 luma)


def simclr_views(images: torch.Tensor | list[torch.Tensor], size: int, generator: torch.Generator | None,
                 channels: int = 3) -> torch.Tensor:
    """Two SimCLR views of each of N uint8 images -> float ``2N x C x size x size``, the rows
    ``[view 1 of every image; view 2 of every image]``, normalised like ``views.simclr_transform``.

    ``images``: one ``N x C x H x W`` tensor (images of one size: the crops are resized in one batched product)
    or a list of ``C x H_i x W_i`` tensors. ``channels`` 1 is the gentle recipe of one-channel images (digits):
    crop scale 0.5-1, brightness and contrast jitter only, no grayscale, no flip, mean and std 0.5.

    Every random parameter is drawn on the CPU first, then all of them cross to the device in one copy
    (``_to_device``): nothing here waits for the GPU, and no CPU tensor can be freed under an async copy."""
    n = 2 * len(images)
    device = images.device if isinstance(images, torch.Tensor) else images[0].device
    sizes = (torch.tensor([images.shape[-2:]]).expand(n // 2, 2) if isinstance(images, torch.Tensor)
             else torch.tensor([image.shape[-2:] for image in images])).repeat(2, 1)
    boxes = crop_boxes(sizes, generator, scale=CROP_SCALE if channels == 3 else (0.5, 1.0))

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.empty(n).uniform_(low, high, generator=generator)

    def rows(p: float) -> torch.Tensor:  # the views an op applies to
        return (torch.rand(n, generator=generator) < p).nonzero().squeeze(1)

    b, c, s, h = JITTER
    ops = (adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue)[:4 if channels == 3 else 2]
    factors = torch.stack([uniform(max(0, 1 - b), 1 + b), uniform(max(0, 1 - c), 1 + c),
                           uniform(max(0, 1 - s), 1 + s), uniform(-h, h)][:len(ops)], 1)  # n x ops
    order = torch.randperm(len(ops), generator=generator).tolist()  # one op order per batch
    jitter = rows(P_JITTER)
    kernel = blur_kernel(size)
    none = torch.zeros(0, dtype=torch.long)  # no rows
    gray = rows(P_GRAY) if channels == 3 else none
    blur, sigma = (rows(P_BLUR), uniform(*BLUR_SIGMA)) if kernel is not None else (none, none)
    flip = rows(P_FLIP) if channels == 3 else none
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else ((0.5,), (0.5,))
    (boxes_d, jitter, factors, gray, blur, sigma, flip, mean, std) = _to_device(
        [boxes, jitter, factors[jitter], gray, blur, sigma[blur], flip, torch.tensor(mean), torch.tensor(std)], device)

    x = resized_crop(images, boxes, size, boxes_d).div_(255).clamp_(0, 1)

    def colour(v, f):
        for k in order:
            v = ops[k](v, f[:, k])
        return v

    x = _apply_at(jitter, x, colour, factors)
    x = _apply_at(gray, x, lambda v: grayscale(v).expand_as(v))
    if kernel is not None:
        x = _apply_at(blur, x, lambda v, sg: gaussian_blur(v, sg, kernel), sigma)
    x = _apply_at(flip, x, lambda v: v.flip(-1))
    return x.sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))


def _to_device(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """CPU tensors -> the same tensors on ``device``, in one copy: packed into one pinned buffer (the caching
    host allocator does not reuse it before the copy has run, so nothing freed here is read in flight)
    and moved with one ``non_blocking`` transfer that waits for nothing (a pageable source would make
    CUDA stage it synchronously). Integer parts come back exactly (float64 holds them)."""
    if device.type == "cpu":
        return parts
    flat = torch.cat([p.reshape(-1).double() for p in parts]).pin_memory().to(device, non_blocking=True)
    return [chunk.view(p.shape).to(p.dtype) for chunk, p in zip(flat.split([p.numel() for p in parts]), parts)]


def _apply_at(rows: torch.Tensor, x: torch.Tensor, op, *params: torch.Tensor) -> torch.Tensor:
    """``x`` with ``op(x[rows], *params)`` in ``rows`` (indices already on ``x``'s device, ``params`` one entry per
    row): only the selected rows are computed, and the length of ``rows`` is known without asking the GPU."""
    if len(rows):
        x[rows] = op(x[rows], *params)
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


def resized_crop(images: torch.Tensor | list[torch.Tensor], boxes: torch.Tensor, size: int,
                 device_boxes: torch.Tensor | None = None) -> torch.Tensor:
    """Crop ``boxes[v]`` (top, left, height, width) of image ``v % N`` and resize it to ``size x size`` (bicubic,
    antialiased, like RandomResizedCrop) -> float ``V x C x size x size``; ``V`` is a multiple of the number of
    images N (SimCLR: two boxes per image). ``boxes`` is on the CPU; ``device_boxes``, the same on the images'
    device if the caller has already moved it there.

    ``images`` as one ``N x C x H x W`` tensor (images of one size: CIFAR, any training set held on the device):
    all crops in two batched matrix products, ``resize_matrix`` rows x image x columns: a few kernels per
    batch whatever its size. As a list of ``C x H_i x W_i`` images of any sizes: one interpolation per view.
    Padding those to one tensor would cost memory for the largest image in the batch (ImageNet has
    multi-megapixel outliers); per image, the crop's antialiased resize is also 2x faster on a CPU than the
    dense products (a DataLoader worker resizes one image at a time).
    """
    if isinstance(images, list):
        return torch.cat([
            F.interpolate(images[v % len(images)][None, :, t:t + h, l:l + w].float(), size=(size, size),
                          mode="bicubic", antialias=True)
            for v, (t, l, h, w) in enumerate(boxes.tolist())])
    n, c, height, width = images.shape
    views = len(boxes)
    top, left, h, w = (boxes if device_boxes is None else device_boxes).to(images.device).unbind(1)
    rows, cols = resize_matrix(top, h, size, height), resize_matrix(left, w, size, width)  # V x S x H, V x S x W
    # columns first, both views of an image in one product: N x CH x W @ N x W x (V/N)S
    cols = cols.view(views // n, n, size, width).permute(1, 3, 0, 2).reshape(n, width, views // n * size)
    x = images.float().view(n, c * height, width) @ cols
    x = x.view(n, c, height, views // n, size).permute(3, 0, 1, 2, 4).reshape(views, c, height, size)
    return rows.unsqueeze(1) @ x  # V x 1 x S x H @ V x C x H x S


def resize_matrix(start: torch.Tensor, length: torch.Tensor, size: int, extent: int) -> torch.Tensor:
    """``V x size x extent``: row s of matrix v holds the weights that PyTorch's antialiased bicubic resize
    (``F.interpolate(..., mode="bicubic", antialias=True)``, as torchvision's resize calls it) gives pixels
    ``start[v] ... start[v] + length[v] - 1`` of an axis of ``extent`` pixels for output pixel s of ``size``:
    Keys' cubic (a = -0.5) stretched by the scale when shrinking, cut at its support and normalised to sum
    1 (aten's ``_compute_weights_aa``). Zero outside the crop, so a product with the whole image crops too."""
    length = length.to(torch.float32).view(-1, 1, 1)
    scale = length / size
    shrink = scale >= 1
    support = torch.where(shrink, 2 * scale, 2.0)
    center = scale * (torch.arange(size, device=start.device, dtype=torch.float32).view(1, -1, 1) + 0.5)
    low = (center - support + 0.5).trunc().clamp(min=0)  # aten truncates toward zero, like a C cast
    high = torch.minimum((center + support + 0.5).trunc(), length)
    j = torch.arange(extent, device=start.device, dtype=torch.float32).view(1, 1, -1) - start.view(-1, 1, 1)
    t = ((j - center + 0.5) * torch.where(shrink, 1 / scale, 1.0)).abs()
    a = -0.5
    weight = torch.where(t < 1, ((a + 2) * t - (a + 3)) * t * t + 1, (((t - 5) * t + 8) * t - 4) * a)
    weight = weight * ((t < 2) & (j >= low) & (j < high))
    return weight / weight.sum(-1, keepdim=True)


# --------------------------------------------------------------------------------------------- colour


def _per_image(f: torch.Tensor) -> torch.Tensor:
    return f.view(-1, 1, 1, 1)


def _blend(x: torch.Tensor, other: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return (_per_image(f) * x + (1 - _per_image(f)) * other).clamp(0, 1)


def grayscale(x: torch.Tensor) -> torch.Tensor:
    """``B x 3 x H x W`` -> luma ``B x 1 x H x W`` (a one-channel image is its own luma)."""
    if x.shape[1] == 1:
        return x
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
    kernel = blur_taps(sigma, kernel_size).to(x.dtype).repeat_interleave(c, 0)  # BC x k
    pad = kernel_size // 2
    y = F.pad(x, (pad, pad, pad, pad), mode="reflect").view(1, b * c, height + 2 * pad, width + 2 * pad)
    y = F.conv2d(y, kernel.view(b * c, 1, kernel_size, 1), groups=b * c)
    y = F.conv2d(y, kernel.view(b * c, 1, 1, kernel_size), groups=b * c)
    return y.view(b, c, height, width)
