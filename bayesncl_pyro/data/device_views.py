"""SimCLR's augmentation of a whole batch at once, on the training device (``--augment device``).

The worker path (``views.simclr_transform`` in DataLoader workers) decodes and augments one image at a
time on the CPU, which caps the images per second of a GPU machine at what its CPU cores can augment. Here the training
process gets the batch's images (held on the device, or decoded there: ``decode.EncodedImages.decode``) and
draws both views of every image with whole-batch kernels: the recipe of ``simclr_transform`` for colour images
(the constants in ``recipe.py``), with three differences:

- the images stay float in [0, 1] from the crop on (the worker path rounds to uint8 after each op);
- ColorJitter's four ops run in one random order per batch (torchvision draws an order per image);
- every random parameter is drawn on the CPU from the generator the caller passes (the Trainer seeds it
  by seed, step and rank): drawing them never waits for the GPU.

A batch's views are two parts (``BatchViews`` joins them):

- ``ViewParams``: the random draws, made on the CPU with the calls and in the order the views have always
  been drawn with, into one reused byte buffer (on CUDA two pinned ones in turn), which crosses to the device
  in one ``non_blocking`` copy;
- ``ViewChain``: the views as a pure function of the images and those parameters, with static shapes: an op
  applies to every view, a view it should leave alone gets the op's identity parameters (a factor 1, an
  identity blur matrix) or keeps its pixels through a ``torch.where``. So nothing gathers or scatters rows,
  nothing waits for the GPU, and the chain can be captured as a CUDA graph or compiled
  (``torch.compile(fullgraph=True, dynamic=False)``). Images of different sizes are resized from one padded
  batch (``padded_batch``: sides rounded up to multiples of 64, so that few shapes occur), each crop's resize
  matrix being zero outside it; the rare image far larger than the batch's others is resized on its own.

On the CPU the chain computes what the gather/scatter version computed, in the same float32 operations: the
views of a generator are the same bits (``tests/data/test_device_views.py`` keeps that version to compare). The
blur is the exception, now two band-matrix products (equal to torchvision's within 1e-5), and the resize of
images of different sizes (a padded product, equal to per-image ``F.interpolate`` within float rounding).
Each op equals torchvision's ``transforms.v2.functional`` op applied image by image.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

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

_GRAY_WEIGHTS = (0.2989, 0.587, 0.114)  # torchvision's (ITU-R 601-2 luma)
TRIES = 10  # RandomResizedCrop's draws of (area, aspect) per crop
BUCKET = 64
"""Padded batches of images of different sizes have sides that are multiples of this (``padded_batch``)."""
OUTLIER = 1.25
"""An image with a side above this times the batch's median side (rounded up to ``BUCKET``) is resized alone."""


# ------------------------------------------------------------------------------------------ the parameters


class ViewParams:
    """The random parameters of a batch's views, and its images' sizes and rows, in one byte buffer.

    Batches of ``n`` images; sizes ``n x 2`` (height, width); rows only for a training set held on the device. The
    buffer holds typed fields.

    ``draw`` fills it from a CPU generator with exactly the draws the views have always been made from (the same
    calls, shapes and order: the crops' area and aspect tries and their corner, the four jitter factors, the
    jitter order, then a chance per view for the jitter, the grayscale, the blur (and its sigma) and the flip that
    the recipe has); ``to_device`` gives the same fields on ``device``. On CUDA the host side is two pinned
    buffers, filled in turn, and each crosses in one ``non_blocking`` copy: a buffer is written again only once
    its copy has run (an event, which the host has normally passed long before; else it waits for that copy
    only). Elsewhere the device's fields are the host's.
    """

    def __init__(self, n: int, size: int, channels: int, device: torch.device, rows: bool = False):
        views, self.channels = 2 * n, channels
        self.blur = blur_kernel(size) is not None
        self.chances = 1 + self.blur + 2 * (channels == 3)  # jitter, [grayscale], [blur], [flip]
        self.fields = {"sizes": (torch.float64, (n, 2)), "area": (torch.float64, (views, TRIES)),
                       "log_ratio": (torch.float64, (views, TRIES)), "corner": (torch.float64, (views, 2)),
                       "factors": (torch.float32, (4, views)), "order": (torch.int64, (4 if channels == 3 else 2,)),
                       "chance": (torch.float32, (self.chances, views)), "sigma": (torch.float32, (views,))}
        if rows:
            self.fields["rows"] = (torch.int64, (n,))
        self.nbytes = sum(-(-math.prod(shape) * dtype.itemsize // 8) * 8 for dtype, shape in self.fields.values())
        self.cuda = device.type == "cuda"
        self.raw = [torch.empty(self.nbytes, dtype=torch.uint8) for _ in range(2 if self.cuda else 1)]
        if self.cuda:
            self.raw = [buffer.pin_memory() for buffer in self.raw]
            self.raw_device = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
            self.device = self._fields(self.raw_device)
        self.host = [self._fields(buffer) for buffer in self.raw]
        if not self.cuda:
            self.device = self.host[0]
        self.copied: list[torch.cuda.Event | None] = [None] * len(self.raw)  # each pinned buffer's latest copy
        self.slot = 0

    def _fields(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        fields, start = {}, 0
        for name, (dtype, shape) in self.fields.items():
            size = math.prod(shape) * dtype.itemsize
            fields[name] = buffer[start:start + size].view(dtype).view(shape)
            start += -(-size // 8) * 8
        return fields

    def draw(self, generator: torch.Generator | None, sizes: torch.Tensor | None = None,
             rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Draw the next batch's parameters on the CPU into the next host buffer and return its fields.

        ``sizes`` (``n x 2``) is written only when given: a training set of one size sets it once.
        """
        self.slot = (self.slot + 1) % len(self.host)
        if self.copied[self.slot] is not None and not self.copied[self.slot].query():
            self.copied[self.slot].synchronize()  # the GPU lags two batches behind: wait for this buffer's copy only
        p = self.host[self.slot]
        if sizes is not None:
            p["sizes"].copy_(sizes)
        if rows is not None:
            p["rows"].copy_(rows)
        scale = CROP_SCALE if self.channels == 3 else (0.5, 1.0)  # one-channel images (digits) crop gently
        p["area"].uniform_(*scale, generator=generator)
        p["log_ratio"].uniform_(*map(math.log, CROP_RATIO), generator=generator)
        p["corner"].uniform_(generator=generator)
        for factors, (low, high) in zip(p["factors"], _JITTER_RANGES):  # all four, for one channel too
            factors.uniform_(low, high, generator=generator)
        torch.randperm(len(p["order"]), generator=generator, out=p["order"])  # one jitter order per batch
        chance = iter(p["chance"])
        next(chance).uniform_(generator=generator)  # jitter
        if self.channels == 3:
            next(chance).uniform_(generator=generator)  # grayscale
        if self.blur:
            next(chance).uniform_(generator=generator)
            p["sigma"].uniform_(*BLUR_SIGMA, generator=generator)
        if self.channels == 3:
            next(chance).uniform_(generator=generator)  # flip
        return p

    def to_device(self) -> dict[str, torch.Tensor]:
        """The fields of the last ``draw`` on the device: on CUDA copied there on the current stream (one copy)."""
        if not self.cuda:
            return self.host[self.slot]
        self.raw_device.copy_(self.raw[self.slot], non_blocking=True)
        self.copied[self.slot] = torch.cuda.Event()
        self.copied[self.slot].record()
        return self.device


_JITTER_RANGES = [(max(0, 1 - f), 1 + f) for f in JITTER[:3]] + [(-JITTER[3], JITTER[3])]


# ------------------------------------------------------------------------------------------------ the views


class ViewChain:
    """Both views of a batch of images as a pure function of the images and the view parameters.

    The images are ``n x C x H x W`` of values 0-255, of one size or padded (``padded_batch``); the parameters are
    the device fields of ``ViewParams``; out: ``2n x C x size x size`` of
    ``dtype`` in ``memory_format``, rows ``[view 1 of every image; view 2 of every image]``, normalised like
    ``views.simclr_transform``. ``channels`` 1 is the gentle recipe of one-channel images (digits): crop scale
    0.5-1, brightness and contrast jitter only, no grayscale, no flip, mean and std 0.5.

    ``static`` (for a CUDA graph or ``torch.compile``): the jitter order is read from the device parameters, so the
    ops run in fixed slots (``jitter_in_slots``); otherwise in the order given on the host (``jitter_in_order``),
    which computes the same bits with fewer ops.
    """

    def __init__(self, size: int, channels: int, device: torch.device, dtype: torch.dtype = torch.float32,
                 memory_format: torch.memory_format = torch.contiguous_format, static: bool = False):
        self.size, self.channels, self.static = size, channels, static
        self.dtype = dtype
        self.memory_format = torch.contiguous_format if memory_format == torch.preserve_format else memory_format
        self.kernel = blur_kernel(size)
        mean, std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else ((0.5,), (0.5,))
        # made here, once, by kernels: a tensor made from host data is a copy the host waits for, and in the chain
        # one a CUDA graph cannot hold
        self.mean, self.std = (torch.empty(len(v), 1, 1, device=device) for v in (mean, std))
        for t, values in ((self.mean, mean), (self.std, std)):
            for row, value in zip(t, values):
                row.fill_(value)
        self.eye = torch.eye(size, device=device)

    def __call__(self, images: torch.Tensor, p: dict[str, torch.Tensor], order: list[int] | None = None
                 ) -> torch.Tensor:
        """Both views of ``images`` drawn with the parameters ``p``: ``resize``, then ``augment``."""
        return self.augment(self.resize(images, p), p, order)

    def resize(self, images: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        """RandomResizedCrop of both views of every image -> float ``2n x C x size x size`` in [0, 1]."""
        boxes = boxes_from_draws(p["sizes"].repeat(2, 1), p["area"], p["log_ratio"], p["corner"])
        return resized_crop(images, boxes, self.size).div_(255).clamp_(0, 1)

    def augment(self, x: torch.Tensor, p: dict[str, torch.Tensor], order: list[int] | None = None) -> torch.Tensor:
        """Colour jitter, grayscale, blur, flip and normalisation of the resized views ``x`` (overwritten)."""
        chance = iter(p["chance"])
        jittered = next(chance) < P_JITTER
        # a view not jittered gets factor 1: brightness, contrast and saturation leave it as it is, exactly
        factors = torch.where(jittered, p["factors"], 1.0)
        if self.static:
            x = jitter_in_slots(x, factors, jittered, p["order"])
        else:
            x = jitter_in_order(x, factors, jittered, order)
        if self.channels == 3:
            x = torch.where(_per_image(next(chance) < P_GRAY), grayscale(x), x)
        if self.kernel is not None:
            blurred = (next(chance) < P_BLUR).view(-1, 1, 1)
            m = torch.where(blurred, band_matrices(blur_taps(p["sigma"], self.kernel), self.size), self.eye)
            x = m.unsqueeze(1) @ x @ m.transpose(1, 2).unsqueeze(1)  # rows, then columns
        if self.channels == 3:
            # the flip stays last: folded into the resize, it would change the order in which contrast's mean sums
            # the pixels, and with it the views' last bits
            x = torch.where(_per_image(next(chance) < P_FLIP), x.flip(-1), x)
        out = torch.empty(x.shape, dtype=self.dtype, device=x.device, memory_format=self.memory_format)
        return torch.div(x.sub_(self.mean), self.std, out=out)


_OPS = ("brightness", "contrast", "saturation", "hue")


def jitter_in_order(x: torch.Tensor, factors: torch.Tensor, jittered: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Apply ColorJitter's ops in ``order``, a list on the host.

    ``factors``: 4 x V, 1 for the three blends of a view not jittered. Every view gets the float operations, in the
    order of the gather/scatter version.
    """
    for k in order:
        if k == 3:
            x = torch.where(_per_image(jittered), adjust_hue(x, factors[3]), x)
        else:
            x = (adjust_brightness, adjust_contrast, adjust_saturation)[k](x, factors[k])
    return x


def jitter_in_slots(x: torch.Tensor, factors: torch.Tensor, jittered: torch.Tensor, order: torch.Tensor
                    ) -> torch.Tensor:
    """``jitter_in_order`` with the order a device tensor: a static sequence of ops, the same bits.

    Every blend is
    ``blend(x, a, b, c)``: brightness (f, 0, 0), contrast (f, 0, 1 - f), saturation (f, 1 - f, 0), none (1, 0, 0),
    which adds zeros exactly where a blend has no such term. Colour images get three blend slots, the hue, three
    more: the ops drawn before the hue fill the first slots, those after it the last, none the rest; digits' two
    blends run in two slots.
    """
    one, zero = torch.ones_like(factors[0]), torch.zeros_like(factors[0])
    blends = [(factors[0], zero, zero), (factors[1], zero, 1 - factors[1])]
    if len(order) == 4:
        blends += [(factors[2], 1 - factors[2], zero), (one, zero, zero)]  # saturation, and none (slot 3 of 4)
    coef = torch.stack([torch.stack(c) for c in blends])  # blend x (a, gray, mean) x V
    if len(order) == 2:
        slots = order
    else:
        hue_at = (order == 3).long().argmax()
        k = torch.arange(3, device=order.device)
        after = k + hue_at + 1
        slots = torch.cat([torch.where(k < hue_at, order[:3], 3),
                           torch.where(after <= 3, order.gather(0, after.clamp(max=3)), 3)])
    for t, (a, b, c) in enumerate(coef.index_select(0, slots)):
        if t == 3:
            x = torch.where(_per_image(jittered), adjust_hue(x, factors[3]), x)
        x = blend(x, a, b, c)
    return x


def _per_image(f: torch.Tensor) -> torch.Tensor:
    return f.view(-1, 1, 1, 1)


def blend(x: torch.Tensor, a: torch.Tensor, gray: torch.Tensor | None = None, mean: torch.Tensor | None = None
          ) -> torch.Tensor:
    """Blend each image with its luma and mean luma, then clamp to [0, 1].

    Computes ``clamp(a x + gray * luma(x) + mean * mean luma(x), 0, 1)``, image by image (each a length-B tensor; None:
    no such term), summed in that order: ColorJitter's brightness, contrast and saturation.
    """
    y = _per_image(a) * x
    if gray is not None or mean is not None:
        luma = grayscale(x)
        if gray is not None:
            y = y + _per_image(gray) * luma
        if mean is not None:
            y = y + _per_image(mean) * luma.mean((1, 2, 3), keepdim=True)
    return y.clamp(0, 1)


def adjust_brightness(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Scale each image by its factor (ColorJitter's brightness)."""
    return blend(x, f)


def adjust_contrast(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Blend each image with its mean luma."""
    return blend(x, f, mean=1 - f)


def adjust_saturation(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Blend each image with its luma image."""
    return blend(x, f, gray=1 - f)


def grayscale(x: torch.Tensor) -> torch.Tensor:
    """``B x 3 x H x W`` -> luma ``B x 1 x H x W`` (a one-channel image is its own luma)."""
    if x.shape[1] == 1:
        return x
    r, g, b = x.unbind(1)
    return (_GRAY_WEIGHTS[0] * r + _GRAY_WEIGHTS[1] * g + _GRAY_WEIGHTS[2] * b).unsqueeze(1)


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


def band_matrices(taps: torch.Tensor, n: int) -> torch.Tensor:
    """Reflect-padded 1-D convolution matrices, one per row of ``taps``.

    ``B x n x n``: matrix b is the 1-D convolution with ``taps[b]`` (``B x k``, centred) of a length-``n``
    signal reflected at its ends (``n`` > half the taps, as ``blur_kernel`` makes sure), as torchvision pads.
    """
    k = taps.shape[-1]
    j = (torch.arange(n, device=taps.device)[:, None] + torch.arange(k, device=taps.device) - k // 2).abs()
    j = torch.where(j > n - 1, 2 * (n - 1) - j, j)  # reflect at 0, then at n - 1
    return torch.zeros(len(taps), n, n, device=taps.device).scatter_add_(
        2, j.expand(len(taps), n, k), taps[:, None, :].expand(len(taps), n, k))


def gaussian_blur(x: torch.Tensor, sigma: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Gaussian blur of each image with its own sigma, reflecting at the borders.

    The Gaussian has ``kernel_size`` taps and standard deviation ``sigma[i]`` (pixels) for image i; a product with a
    band matrix on each side.
    """
    taps = blur_taps(sigma, kernel_size).to(x.dtype)
    rows, cols = band_matrices(taps, x.shape[-2]), band_matrices(taps, x.shape[-1])
    return rows.unsqueeze(1) @ x @ cols.transpose(1, 2).unsqueeze(1)


# --------------------------------------------------------------------------------------------------- crop


def crop_boxes(sizes: torch.Tensor, generator: torch.Generator, scale=CROP_SCALE, ratio=CROP_RATIO) -> torch.Tensor:
    """RandomResizedCrop's boxes for images of ``sizes``, drawn as ``ViewParams`` draws them.

    ``sizes`` (``N x 2``: height, width) -> ``N x 4`` long (top, left, height, width), via ``boxes_from_draws``.
    """
    n = len(sizes)
    area = torch.empty(n, TRIES, dtype=torch.double).uniform_(*scale, generator=generator)
    log_ratio = torch.empty(n, TRIES, dtype=torch.double).uniform_(*map(math.log, ratio), generator=generator)
    corner = torch.rand(n, 2, dtype=torch.double, generator=generator)
    return boxes_from_draws(sizes, area, log_ratio, corner, ratio)


def boxes_from_draws(sizes: torch.Tensor, area: torch.Tensor, log_ratio: torch.Tensor, corner: torch.Tensor,
                     ratio=CROP_RATIO) -> torch.Tensor:
    """RandomResizedCrop's boxes, as torchvision draws them, for all images at once.

    ``sizes`` (``N x 2``), from
    ``TRIES`` uniform draws per image of the area (a share of the image's) and of the log aspect, and a uniform
    ``corner`` (``N x 2``) -> ``N x 4`` long (top, left, height, width): the first try that fits the image, else the
    central crop of the clamped aspect. On the device of the draws; in float64, whose rounding decides a side only
    in the rare tie.
    """
    height, width = sizes[:, :1].double(), sizes[:, 1:].double()  # N x 1
    area = height * width * area
    w = (area * log_ratio.exp()).sqrt().round()
    h = (area / log_ratio.exp()).sqrt().round()
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = fits.double().argmax(1, keepdim=True)  # the first try that fits (0 if none does)
    h, w = h.gather(1, first), w.gather(1, first)
    top, left = (corner[:, :1] * (height - h + 1)).floor(), (corner[:, 1:] * (width - w + 1)).floor()
    # no try fits: the whole image, cut to the nearest allowed aspect ratio, centred
    fw = torch.minimum(width, (height * ratio[1]).round())
    fh = torch.minimum(height, (width / ratio[0]).round())
    none = ~fits.any(1, keepdim=True)
    h, w = torch.where(none, fh, h), torch.where(none, fw, w)
    top = torch.where(none, ((height - fh) / 2).floor(), top)
    left = torch.where(none, ((width - fw) / 2).floor(), left)
    return torch.cat([top, left, h, w], 1).long()


def resized_crop(images: torch.Tensor | list[torch.Tensor], boxes: torch.Tensor, size: int) -> torch.Tensor:
    """Crop each box of its image and resize it to ``size x size`` (bicubic, antialiased).

    Box ``boxes[v]`` (top, left, height, width) is of image ``v % N``, resized like RandomResizedCrop -> float ``V x C x
    size x size``; ``V`` is a multiple of the number of images N (SimCLR: two boxes per image), ``boxes`` on the images'
    device.

    ``images`` as one ``N x C x H x W`` tensor (of one size, or padded: the boxes lie inside each image's own size):
    all crops in two batched matrix products, ``resize_matrix`` rows x image x columns: a few kernels per batch
    whatever its size. As a list of ``C x H_i x W_i`` images (``boxes`` on the CPU): one interpolation per view,
    faster on a CPU than the dense products for one image (what a DataLoader worker resizes, and an image too
    large to pad its batch to: ``padded_batch``).
    """
    if isinstance(images, list):
        return torch.cat([
            F.interpolate(images[v % len(images)][None, :, t:t + h, l:l + w].float(), size=(size, size),
                          mode="bicubic", antialias=True)
            for v, (t, l, h, w) in enumerate(boxes.tolist())])  # noqa: E741 (top, left, height, width)
    n, c, height, width = images.shape
    views = len(boxes)
    top, left, h, w = boxes.unbind(1)
    rows, cols = resize_matrix(top, h, size, height), resize_matrix(left, w, size, width)  # V x S x H, V x S x W
    # columns first, both views of an image in one product: N x CH x W @ N x W x (V/N)S
    cols = cols.view(views // n, n, size, width).permute(1, 3, 0, 2).reshape(n, width, views // n * size)
    x = images.float().view(n, c * height, width) @ cols
    x = x.view(n, c, height, views // n, size).permute(3, 0, 1, 2, 4).reshape(views, c, height, size)
    return rows.unsqueeze(1) @ x  # V x 1 x S x H @ V x C x H x S


def resize_matrix(start: torch.Tensor, length: torch.Tensor, size: int, extent: int) -> torch.Tensor:
    """The matrices of PyTorch's antialiased bicubic resize of crops of one axis.

    ``V x size x extent``: row s of matrix v holds the weights that PyTorch's antialiased bicubic resize
    (``F.interpolate(..., mode="bicubic", antialias=True)``, as torchvision's resize calls it) gives pixels
    ``start[v] ... start[v] + length[v] - 1`` of an axis of ``extent`` pixels for output pixel s of ``size``:
    Keys' cubic (a = -0.5) stretched by the scale when shrinking, cut at its support and normalised to sum
    1 (aten's ``_compute_weights_aa``). Zero outside the crop, so a product with the whole image crops too.
    """
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


def padded_batch(images: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Pad images of any sizes into one uint8 tensor, leaving out the few far larger ones.

    uint8 ``C x H_i x W_i`` images -> (one uint8 ``N x C x H x W`` tensor of them, zero below and
    right of each, its sides rounded up to multiples of ``BUCKET``, so that batches share a few shapes; the indices of
    the images left out of it). An image with a side above ``OUTLIER`` times the batch's median side (ImageNet's rare
    multi-megapixel photos) would multiply the batch's memory and arithmetic: it is left out (a 1 x 1 pixel stands
    in) and resized alone (``resized_crop`` of a list). Two calls: the images go into one nested tensor, padded on
    the device image by image. Not in floating point: CUDA's one-kernel path for that copies the images' sizes to
    the device with a blocking copy, a wait for the stream each batch.
    """
    sides = sorted(max(image.shape[-2:]) for image in images)
    cap = _bucket(OUTLIER * sides[len(sides) // 2])
    outliers = [k for k, image in enumerate(images) if max(image.shape[-2:]) > cap]
    kept = [image if k not in outliers else image[:, :1, :1] for k, image in enumerate(images)]
    shape = (len(images), images[0].shape[0], _bucket(max(image.shape[-2] for image in kept)),
             _bucket(max(image.shape[-1] for image in kept)))
    with warnings.catch_warnings():  # strided nested tensors are a prototype: that layout's two calls are all we use
        warnings.simplefilter("ignore", UserWarning)
        return torch.nested.to_padded_tensor(torch.nested.as_nested_tensor(kept), 0, shape), outliers


def _bucket(side: float) -> int:
    return BUCKET * math.ceil(side / BUCKET)


# ----------------------------------------------------------------------------------------- a batch's views


class BatchViews:
    """Both SimCLR views of batches of ``n`` images on ``device``.

    ``ViewParams`` drawn, then ``ViewChain``:
    ``views(images, generator)``, ``images`` one uint8 ``n x C x H x W`` tensor (of one size) or a list of
    ``C x H_i x W_i`` images (padded: ``padded_batch``); ``views(images, generator, rows)``: the batch is rows
    ``rows`` (a CPU long tensor) of a set ``images`` held on the device (``rows=True`` here). The parameter buffers are
    reused from batch to batch. ``compile``: the chain is compiled (``torch.compile(fullgraph=True, dynamic=False)``:
    one compilation per shape of images).
    """

    def __init__(self, n: int, size: int, channels: int, device: torch.device, dtype: torch.dtype = torch.float32,
                 memory_format: torch.memory_format = torch.contiguous_format, rows: bool = False,
                 compile: bool = False):
        self.params = ViewParams(n, size, channels, device, rows)
        self.chain = ViewChain(size, channels, device, dtype, memory_format, static=compile)
        self.resize, self.augment = self.chain.resize, self.chain.augment
        if compile:
            self.resize, self.augment = (torch.compile(f, fullgraph=True, dynamic=False) for f in (self.resize,
                                                                                                  self.augment))
        self.size = size

    def __call__(self, images: torch.Tensor | list[torch.Tensor], generator: torch.Generator | None,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        """Both views of a batch (``images``, or rows ``rows`` of a held set), drawn from ``generator``."""
        outliers = []
        if isinstance(images, list):
            sizes = torch.tensor([image.shape[-2:] for image in images], dtype=torch.float64)
            padded, outliers = padded_batch(images)
        else:
            sizes = torch.tensor([images.shape[-2:]], dtype=torch.float64).expand(len(self.params.host[0]["sizes"]), 2)
            padded = images
        host = self.params.draw(generator, sizes, rows)
        p = self.params.to_device()
        if rows is not None:
            padded = images.index_select(0, p["rows"])
        x = self.resize(padded, p)
        for k in outliers:
            self.resize_alone(x, images, k, host)
        return self.augment(x, p, None if self.chain.static else host["order"].tolist())

    def resize_alone(self, x: torch.Tensor, images: list[torch.Tensor], k: int, host: dict[str, torch.Tensor]):
        """Write the resized views of an image left out of the padded batch into its rows of ``x``.

        The image is ``images[k]``; its boxes are computed on the host from the host parameters.
        """
        views = [k, k + len(images)]
        boxes = boxes_from_draws(host["sizes"][[k, k]], host["area"][views], host["log_ratio"][views],
                                 host["corner"][views])
        crops = resized_crop([images[k]], boxes, self.size).div_(255).clamp_(0, 1)
        for v, crop in zip(views, crops):
            x[v].copy_(crop)  # an index held on the host would make CUDA wait for a copy: one row at a time


def simclr_views(images: torch.Tensor | list[torch.Tensor], size: int, generator: torch.Generator | None,
                 channels: int = 3) -> torch.Tensor:
    """Two SimCLR views of each of N uint8 images.

    Out: float ``2N x C x size x size`` (``BatchViews``, made for this one
    batch), the rows ``[view 1 of every image; view 2 of every image]``.
    """
    device = images.device if isinstance(images, torch.Tensor) else images[0].device
    return BatchViews(len(images), size, channels, device)(images, generator)
