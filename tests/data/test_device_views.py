"""The batched data path (--augment device).

Each op against torchvision, decoding and its fallbacks, seeding, training.
"""

import io
import logging
import subprocess
import sys
import types
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_resume_is_exact, photo_tree, truncate, write_photo
from PIL import Image
from torchvision.transforms import InterpolationMode, RandomResizedCrop
from torchvision.transforms.v2 import functional as TF

from bayesncl_pyro.config import Config
from bayesncl_pyro.data import device_views as D
from bayesncl_pyro.data import load_dataset
from bayesncl_pyro.data.decode import EncodedBatch, EncodedImages
from bayesncl_pyro.data.pipeline import EpochSampler, FileViews, ResidentViews
from bayesncl_pyro.data.recipe import IMAGENET_MEAN, IMAGENET_STD
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.train.trainer import Trainer

TOL = dict(rtol=0, atol=1e-5)  # float32 rounding: the ops compute the same formulas in another order


def per_image(op, x, *params):
    """torchvision's op applied image by image, each with its own parameters."""
    return torch.stack([op(x[i], *(p[i].item() for p in params)) for i in range(len(x))])


@pytest.mark.parametrize("name", ["brightness", "contrast", "saturation", "hue", "grayscale", "blur"])
def test_each_op_equals_torchvision_image_by_image(name):
    torch.manual_seed(0)
    x = torch.rand(6, 3, 20, 25)
    x[0, :, :5] = 0.5  # flat gray: no hue
    x[1, :, :, :5] = torch.tensor([0.9, 0.9, 0.1]).view(3, 1, 1)  # ties of the largest channel
    factor, hue, sigma = torch.rand(6) * 1.6 + 0.2, torch.rand(6) - 0.5, torch.rand(6) * 1.9 + 0.1
    got, expected = {
        "brightness": (D.adjust_brightness(x, factor), per_image(TF.adjust_brightness, x, factor)),
        "contrast": (D.adjust_contrast(x, factor), per_image(TF.adjust_contrast, x, factor)),
        "saturation": (D.adjust_saturation(x, factor), per_image(TF.adjust_saturation, x, factor)),
        "hue": (D.adjust_hue(x, hue), per_image(TF.adjust_hue, x, hue)),
        "grayscale": (D.grayscale(x), per_image(TF.rgb_to_grayscale, x)),
        "blur": (D.gaussian_blur(x, sigma, 7), per_image(lambda v, s: TF.gaussian_blur(v, [7, 7], [s, s]), x, sigma)),
    }[name]
    torch.testing.assert_close(got, expected, **TOL)


def _torchvision_crops(images, boxes, size):
    """torchvision's RandomResizedCrop resize of each box of image ``v % N``, computed in float64."""
    return torch.stack([TF.resized_crop(images[v % len(images)].double(), *box, [size, size],
                                        interpolation=InterpolationMode.BICUBIC, antialias=True).float()
                        for v, box in enumerate(boxes.tolist())])


def test_resized_crop_equals_torchvision_on_images_of_different_sizes():
    torch.manual_seed(0)
    images = [torch.rand(3, 30 + 9 * i, 50 - 4 * i) * 255 for i in range(5)]
    boxes = D.crop_boxes(torch.tensor([im.shape[-2:] for im in images]).repeat(2, 1), torch.Generator().manual_seed(0))
    # float32 rounding: aten's own float32 resize is 4e-3 off the float64 one on pixel values up to 255
    torch.testing.assert_close(D.resized_crop(images, boxes, 16), _torchvision_crops(images, boxes, 16),
                               rtol=0, atol=2e-2)
    as_uint8 = [im.round().to(torch.uint8) for im in images]  # what decoding gives
    torch.testing.assert_close(D.resized_crop(as_uint8, boxes, 16),
                               D.resized_crop([im.float() for im in as_uint8], boxes, 16), rtol=0, atol=0)


@pytest.mark.parametrize("size", [32, 24, 50])  # same size, shrinking, enlarging: both branches of the filter
def test_batched_resized_crop_of_equal_size_images_equals_torchvision(size):
    torch.manual_seed(0)
    images = torch.randint(0, 256, (6, 3, 32, 40), dtype=torch.uint8)
    boxes = D.crop_boxes(torch.tensor([[32, 40]]).repeat(12, 1), torch.Generator().manual_seed(1))  # two per image
    boxes[0] = torch.tensor([0, 0, 32, 40])  # the whole image
    boxes[1] = torch.tensor([31, 39, 1, 1])  # one pixel, in the corner
    got = D.resized_crop(images, boxes, size)
    assert got.shape == (12, 3, size, size)
    torch.testing.assert_close(got, _torchvision_crops(images, boxes, size), rtol=0, atol=1e-3)


def test_views_of_an_image_tensor_and_of_its_list_agree():
    images = torch.randint(0, 256, (5, 3, 32, 32), dtype=torch.uint8)
    batched = D.simclr_views(images, 32, torch.Generator().manual_seed(0))
    listed = D.simclr_views(list(images), 32, torch.Generator().manual_seed(0))
    torch.testing.assert_close(batched, listed, rtol=0, atol=1e-4)  # the same draws, float32 rounding apart


def _gather_scatter_views(images, size, generator, channels=3):
    """The views as they were drawn before they were whole-batch ops (the same draws, each op on its rows gathered
    and scattered back, the blur a grouped convolution): what ``simclr_views`` must still give."""
    n = 2 * len(images)
    sizes = torch.tensor([images.shape[-2:]]).expand(n // 2, 2).repeat(2, 1)
    boxes = D.crop_boxes(sizes, generator, scale=(0.08, 1.0) if channels == 3 else (0.5, 1.0))

    def uniform(low, high):
        return torch.empty(n).uniform_(low, high, generator=generator)

    def rows(p):
        return (torch.rand(n, generator=generator) < p).nonzero().squeeze(1)

    ops = (D.adjust_brightness, D.adjust_contrast, D.adjust_saturation, D.adjust_hue)[:4 if channels == 3 else 2]
    factors = torch.stack([uniform(0.2, 1.8), uniform(0.2, 1.8), uniform(0.2, 1.8), uniform(-0.2, 0.2)][:len(ops)], 1)
    order = torch.randperm(len(ops), generator=generator).tolist()
    jitter, kernel, none = rows(0.8), D.blur_kernel(size), torch.zeros(0, dtype=torch.long)
    gray = rows(0.2) if channels == 3 else none
    blur, sigma = (rows(0.5), uniform(0.1, 2.0)) if kernel is not None else (none, none)
    flip = rows(0.5) if channels == 3 else none
    x = D.resized_crop(images, boxes, size).div_(255).clamp_(0, 1)

    def apply_at(r, x, op, *params):
        if len(r):
            x[r] = op(x[r], *params)
        return x

    def colour(v, f):
        for k in order:
            v = ops[k](v, f[:, k])
        return v

    def conv_blur(v, sg):
        b, c, h, w = v.shape
        taps = D.blur_taps(sg, kernel).repeat_interleave(c, 0)
        y = F.pad(v, (kernel // 2,) * 4, mode="reflect").view(1, b * c, h + kernel - 1, w + kernel - 1)
        y = F.conv2d(F.conv2d(y, taps.view(b * c, 1, kernel, 1), groups=b * c), taps.view(b * c, 1, 1, kernel),
                     groups=b * c)
        return y.view(b, c, h, w)

    x = apply_at(jitter, x, colour, factors[jitter])
    x = apply_at(gray, x, lambda v: D.grayscale(v).expand_as(v))
    x = apply_at(blur, x, conv_blur, sigma[blur])
    x = apply_at(flip, x, lambda v: v.flip(-1))
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else ((0.5,), (0.5,))
    return x.sub_(torch.tensor(mean).view(-1, 1, 1)).div_(torch.tensor(std).view(-1, 1, 1))


@pytest.mark.parametrize("channels, size, side", [(3, 32, 32), (1, 8, 8), (3, 24, 40), (3, 48, 64)])
def test_whole_batch_views_are_the_gathered_ones_bit_for_bit_the_blur_within_rounding(channels, size, side):
    """Masked blends with identity factors, grayscale and hue through torch.where, the parameters from one buffer:
    on the CPU the same float32 operations on every pixel as the gathered rows had, so the same bits (the default
    first run's figures depend on it); the blur, now two band-matrix products, within float32 rounding."""
    images = torch.randint(0, 256, (12, channels, side, side - 4), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(side))
    for seed in range(2):
        expected = _gather_scatter_views(images, size, torch.Generator().manual_seed(seed), channels)
        got = D.simclr_views(images, size, torch.Generator().manual_seed(seed), channels)
        views = D.BatchViews(len(images), size, channels, torch.device("cpu"), compile=False)
        views.chain.static = True  # the jitter order read from a tensor, in fixed slots (graphs, compile)
        slots = views(images, torch.Generator().manual_seed(seed))
        if D.blur_kernel(size) is None:
            assert torch.equal(got, expected) and torch.equal(slots, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
            assert torch.equal(slots, got)


def test_views_come_out_in_the_dtype_and_layout_asked_for():
    images = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    views = D.BatchViews(6, 32, 3, torch.device("cpu"), dtype=torch.bfloat16, memory_format=torch.channels_last)
    x = views(images, torch.Generator().manual_seed(0))
    assert x.dtype == torch.bfloat16 and x.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(x, D.simclr_views(images, 32, torch.Generator().manual_seed(0)).to(torch.bfloat16))


def test_a_padded_batch_resizes_as_each_image_alone_and_an_outlier_is_resized_alone():
    """Images of different sizes, padded to one tensor (sides rounded up to 64) and resized by two products, equal the
    per-image interpolation within float32 rounding; an image far larger than the others is left out of the padding
    and resized alone, in its rows."""
    g = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, 30 + 7 * i, 50 - 4 * i), dtype=torch.uint8, generator=g) for i in range(5)]
    padded, outliers = D.padded_batch(images)
    assert padded.shape == (5, 3, 64, 64) and outliers == [] and padded.dtype == torch.uint8
    for k, image in enumerate(images):
        assert torch.equal(padded[k, :, :image.shape[1], :image.shape[2]], image)
        assert padded[k, :, image.shape[1]:].eq(0).all() and padded[k, :, :, image.shape[2]:].eq(0).all()
    boxes = D.crop_boxes(torch.tensor([im.shape[-2:] for im in images]).repeat(2, 1), g)
    # aten's float32 resize of the crop against the padded product: pixel values up to 255
    torch.testing.assert_close(D.resized_crop(padded, boxes, 16), D.resized_crop(images, boxes, 16), rtol=0, atol=2e-3)

    huge = torch.randint(0, 256, (3, 400, 300), dtype=torch.uint8, generator=g)
    batch = images + [huge]
    padded, outliers = D.padded_batch(batch)
    assert outliers == [5] and padded.shape == (6, 3, 64, 64)
    x = D.simclr_views(batch, 16, torch.Generator().manual_seed(1))
    alone = D.simclr_views([huge] * 6, 16, torch.Generator().manual_seed(1))  # no outlier: the padded path
    torch.testing.assert_close(x[[5, 11]], alone[[5, 11]], rtol=0, atol=1e-4)


@pytest.mark.slow  # compiling the chain's two parts for three shapes takes minutes on two CPU cores
def test_the_chain_compiles_whole_with_static_shapes_and_draws_the_same_views():
    """torch.compile(fullgraph=True, dynamic=False) of the chain succeeds on the CPU (no graph break: nothing waits
    for the device, no shape depends on data), for a set of one size and for padded files, and draws the eager views
    within float32 rounding (Inductor fuses and reorders the arithmetic)."""
    cpu = torch.device("cpu")
    images = torch.randint(0, 256, (8, 3, 64, 60), dtype=torch.uint8)
    files = [torch.randint(0, 256, (3, 30 + 7 * i, 50 - 4 * i), dtype=torch.uint8) for i in range(8)]
    for batch, size in ((images, 32), (images, 48), (files, 48)):
        compiled = D.BatchViews(8, size, 3, cpu, compile=True)
        for seed in range(2):
            torch.testing.assert_close(compiled(batch, torch.Generator().manual_seed(seed)),
                                       D.simclr_views(batch, size, torch.Generator().manual_seed(seed)),
                                       rtol=0, atol=5e-5)


def test_replicated_chroma_is_the_reference_a_gpu_decoder_is_told_apart_from():
    """``photos.replicated_chroma``: a 4:2:0 JPEG with its chroma repeated 2 x 2, as nvJPEG's default decodes it; PIL
    interpolates. Equal on a picture without colour; 10-20 of 255 apart on 32 px colour photos (gpu_check's)."""
    import io

    from bayesncl_pyro.data.photos import photo, replicated_chroma

    def jpeg(image):
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=90)
        return buffer.getvalue()

    gray = photo(0, (32, 32)).convert("L").convert("RGB")
    data = jpeg(gray)
    assert np.abs(replicated_chroma(data).astype(int) - np.asarray(Image.open(io.BytesIO(data)))).max() <= 1
    data = jpeg(photo(1, (32, 32)))
    assert 10 < np.abs(replicated_chroma(data).astype(int) - np.asarray(Image.open(io.BytesIO(data)))).mean() < 20


def test_one_channel_views_follow_the_gentle_recipe():
    images = torch.randint(0, 256, (64, 1, 8, 8), dtype=torch.uint8)
    x = D.simclr_views(images, 8, torch.Generator().manual_seed(0), channels=1)
    assert x.shape == (128, 1, 8, 8) and x.isfinite().all()
    assert x.min() >= -1 - 1e-5 and x.max() <= 1 + 1e-5  # mean and std 0.5
    steady = torch.full((1, 1, 8, 8), 77, dtype=torch.uint8)  # flat: crops, blur-free jitter keep it flat
    v = D.simclr_views(steady, 8, torch.Generator().manual_seed(0), channels=1)
    assert (v - v.mean((2, 3), keepdim=True)).abs().max() < 1e-5


def test_crop_boxes_are_drawn_like_torchvision():
    g = torch.Generator().manual_seed(0)
    boxes = D.crop_boxes(torch.tensor([[375, 500]]).repeat(4000, 1), g)
    top, left, h, w = boxes.T
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 375).all() and (left + w <= 500).all()
    area = (h * w).double() / (375 * 500)
    assert area.min() >= 0.07 and (w / h).min() > 0.74 and (w / h).max() < 1.35
    # the distribution of torchvision's draws (v1's get_params: the algorithm of v2's RandomResizedCrop, faster)
    torch.manual_seed(0)
    draw = partial(RandomResizedCrop.get_params, scale=[0.08, 1.0], ratio=[3 / 4, 4 / 3])
    image = torch.zeros(3, 375, 500)
    ref = torch.tensor([draw(image) for _ in range(4000)]).double()
    ref_area = ref[:, 2] * ref[:, 3] / (375 * 500)
    assert abs(area.mean() - ref_area.mean()) < 0.02 and abs(area.std() - ref_area.std()) < 0.02
    assert abs((w / h).double().log().mean() - (ref[:, 3] / ref[:, 2]).log().mean()) < 0.02
    # images no try fits: torchvision's central crop at the nearest allowed aspect ratio
    for shape in ((1, 100), (100, 1), (1, 1)):
        assert D.crop_boxes(torch.tensor([shape]), g)[0].tolist() == list(draw(torch.zeros(3, *shape)))


def test_encoded_items_decode_to_the_images_pil_reads(tmp_path):
    spec = load_dataset("imagefolder", photo_tree(tmp_path))
    encoded = EncodedImages(spec.train)
    batch = [encoded[i] for i in range(len(encoded))]
    names = [path.name for path, _ in spec.train.samples]
    # colour JPEGs travel as bytes; the others were decoded by the worker
    assert [data.ndim for data, _ in batch] == [3 if n in ("png.png", "gray.jpg", "cmyk.jpg") else 1 for n in names]
    images = encoded.decode(EncodedBatch(batch), torch.device("cpu"))
    for (pil, _), image in zip(spec.train, images, strict=True):
        assert image.dtype == torch.uint8 and image.shape == (3, pil.height, pil.width)
        assert (image.int() - TF.pil_to_tensor(pil).int()).abs().max() <= 1
    subset = load_dataset("imagefolder", tmp_path, train_subset=4).train  # items keep their file's index
    assert [EncodedImages(subset)[i][1] for i in range(4)] == subset.indices


def test_a_rotated_jpeg_is_decoded_by_the_worker_as_pil_reads_it(tmp_path):
    """TorchCodec applies a JPEG's EXIF rotation, PIL (the worker path) does not: the worker decodes such a file."""
    from bayesncl_pyro.data import decode

    photo_tree(tmp_path)
    path = write_photo(tmp_path / "train" / "a" / "rotated.jpg", size=(50, 30))
    with Image.open(path) as image:
        exif = image.getexif()
        exif[0x0112] = 6  # rotate 90 degrees clockwise to view
        image.save(path, exif=exif, quality=90)
    spec = load_dataset("imagefolder", tmp_path)
    encoded = EncodedImages(spec.train)
    k = [p.name for p, _ in spec.train.samples].index("rotated.jpg")
    assert encoded[k][0].shape == (3, 30, 50)  # decoded by the worker, unrotated
    (image,) = encoded.decode(EncodedBatch([encoded[k]]), torch.device("cpu"))
    assert torch.equal(image, TF.pil_to_tensor(spec.train[k][0]))
    codec = [d for d in decode.JPEG_DECODERS if d.name.startswith("TorchCodec")]
    if codec:  # what sending its bytes would have given
        assert codec[0].decode([torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)],
                               torch.device("cpu"))[0].shape == (3, 50, 30)


def test_each_jpeg_decoder_is_found_and_with_none_the_workers_decode(tmp_path, monkeypatch, caplog):
    """nvImageCodec's decoder is preferred (PIL's chroma upsampling), then TorchCodec's (torchvision 0.29 deprecates
    its own, to be removed), then torchvision's; with none the loader workers decode the JPEGs (PIL), as on the worker
    path."""
    import torchvision.io

    from bayesncl_pyro.data import decode

    nvidia = types.ModuleType("nvidia")
    nvidia.nvimgcodec = _FakeNvImageCodec(working=True)
    monkeypatch.setitem(sys.modules, "nvidia", nvidia)  # nvImageCodec installed: preferred
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", nvidia.nvimgcodec)
    assert [d.name.split()[0] for d in decode._installed_decoders()] == ["nvImageCodec", "TorchCodec", "torchvision"]
    monkeypatch.setitem(sys.modules, "nvidia", None)  # not installed
    assert [d.name.split()[0] for d in decode._installed_decoders()] == ["TorchCodec", "torchvision"]
    monkeypatch.setitem(sys.modules, "torchcodec", None)  # not installed
    assert [d.name.split()[0] for d in decode._installed_decoders()] == ["torchvision"]
    monkeypatch.delattr(torchvision.io, "decode_jpeg")  # removed
    monkeypatch.setattr(decode, "JPEG_DECODERS", decode._installed_decoders())
    assert decode.JPEG_DECODERS == []
    photo_tree(tmp_path / "data")
    cfg = Config(dataset="imagefolder", data_dir=str(tmp_path / "data"), encoder="cnn", image_size=16, proj_hidden=16,
                 proj_dim=8, batch_size=4, epochs=1, warmup_epochs=0, workers=0, device="cpu", augment="device",
                 out=str(tmp_path / "run"))
    caplog.set_level(logging.INFO, logger="bayesncl_pyro")  # a note: INFO
    trainer = Trainer(cfg, progress=False)
    assert "note: no JPEG decoder is installed" in caplog.text
    assert all(trainer.input.views.encoded[i][0].ndim == 3 for i in range(len(trainer.input.views.encoded)))
    trainer.train(2)


class _FakeNvImageCodec:
    """nvImageCodec's Python API as ``decode._NvImageCodec`` calls it, decoding with PIL (planar RGB, None for a JPEG it
    cannot decode); ``working=False``: as where it cannot decode at all (0.9 on a machine without a GPU logs 'Unable to
    get device count' and answers None for every image, just as for corrupt files)."""

    __version__ = "0.9 (fake)"
    NVIMGCODEC_DEVICE_CPU_ONLY = -99

    class ColorSpec:
        SRGB = "sRGB"

    class SampleFormat:
        P_RGB = "planar RGB"

    def __init__(self, working: bool):
        self.working, self.calls = working, 0

    def DecodeParams(self, **params):  # noqa: N802 -- the library's names
        return params

    def CodeStream(self, array):  # noqa: N802
        return bytes(array)

    def Decoder(self, device_id, options):  # noqa: N802
        assert ":fancy_upsampling=1" in options
        return self

    def decode(self, streams, params, cuda_stream):
        self.calls += 1
        images = []
        for data in streams:
            try:
                rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")) if self.working else None
            except OSError:
                rgb = None
            images.append(None if rgb is None else np.ascontiguousarray(rgb.transpose(2, 0, 1)))
        return images


def _jpeg_batch(encoded):
    return EncodedBatch([encoded[i] for i in range(len(encoded)) if encoded[i][0].ndim == 1])


def test_an_nvimagecodec_that_cannot_decode_here_gives_way_to_the_next_decoder(tmp_path, monkeypatch, caplog):
    """A batch nvImageCodec fails on is tried against a JPEG known to be good: where that fails too, nvImageCodec cannot
    decode on this device at all; the next decoder takes over, once, and no file is decoded one by one or blamed."""
    from bayesncl_pyro.data import decode

    broken, cpu = _FakeNvImageCodec(working=False), torch.device("cpu")
    fallback = decode.JpegDecoder("PIL", lambda jpegs, device: [
        TF.pil_to_tensor(Image.open(io.BytesIO(bytes(d.numpy())))) for d in jpegs], True)
    monkeypatch.setattr(decode, "JPEG_DECODERS", [decode.JpegDecoder("nvImageCodec (fake)",
                                                                     decode._NvImageCodec(broken), False), fallback])
    monkeypatch.setattr(decode, "_CANNOT", {})
    encoded = EncodedImages(load_dataset("imagefolder", photo_tree(tmp_path)).train)
    batch = _jpeg_batch(encoded)
    caplog.set_level(logging.INFO, logger="bayesncl_pyro")  # a note: INFO
    for _ in range(2):
        images = encoded.decode(batch, cpu)
    assert broken.calls == 2  # the first batch and the known-good JPEG, then never again
    assert "note: nvImageCodec (fake) cannot decode JPEGs on cpu" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(images, fallback.decode([d for d, _ in batch], cpu), strict=True))


def test_a_corrupt_jpeg_in_an_nvimagecodec_batch_is_still_the_files_fault(tmp_path, monkeypatch):
    """nvImageCodec that decodes the known-good JPEG failed on the batch's data: the batch is decoded one by one and the
    corrupt file named, as with any decoder; nvImageCodec stays in use."""
    from bayesncl_pyro.data import decode

    working = _FakeNvImageCodec(working=True)
    monkeypatch.setattr(decode, "JPEG_DECODERS", [decode.JpegDecoder("nvImageCodec (fake)",
                                                                     decode._NvImageCodec(working), False)])
    monkeypatch.setattr(decode, "_CANNOT", {})
    root = photo_tree(tmp_path)
    bad = truncate(root / "train" / "a" / "3.jpg")
    encoded = EncodedImages(load_dataset("imagefolder", root).train)
    batch = _jpeg_batch(encoded)
    with pytest.raises(UserError, match=str(bad)):
        encoded.decode(batch, torch.device("cpu"))
    # the batch and the known-good JPEG, then one by one, the known-good JPEG again after the one that fails alone
    assert working.calls == 1 + 1 + len(batch) + 1 and not decode._CANNOT


def test_the_file_loader_sends_a_batch_over_one_file_descriptor_under_a_low_open_file_limit(tmp_path):
    """Each image travelled from a loader worker as a shared-memory tensor of its own, each over a file descriptor
    held until the batch was received: at batch 256, 4 workers and the common limit of 1024 the training process died
    (``received 0 items of ancdata``, or ``Too many open files``). Here a limit of 128 and 4 workers: 512 images in
    flight."""
    for i in range(300):
        write_photo(tmp_path / "data" / ("val" if i < 4 else "train") / f"c{i % 2}" / f"{i}.jpg", size=(8 + i % 5, 8),
                    seed=i)
    script = f"""
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from bayesncl_pyro.config import Config
from bayesncl_pyro.data.pipeline import EpochSampler, FileViews
from bayesncl_pyro.train.trainer import Trainer
cfg = Config(dataset="imagefolder", data_dir={str(tmp_path / "data")!r}, encoder="cnn", image_size=8, proj_hidden=16,
             proj_dim=8, batch_size=64, epochs=1, warmup_epochs=0, workers=4, device="cpu", augment="device",
             out={str(tmp_path / "run")!r})
trainer = Trainer(cfg, progress=False)
views = trainer.input.views
assert isinstance(views, FileViews)
sampler = EpochSampler(len(trainer.data.train), cfg.batch_size, cfg.seed)
for epoch in range(2):
    sampler.set_epoch(epoch)
    print(sum(len(views.encoded.decode(batch, trainer.device)) for batch in trainer.input.loader(sampler)))
"""
    try:  # a worker whose batch cannot be sent loses it, and the loader waits for it for ever
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the loader hung: {(err.stderr or b'')[-2000:].decode(errors='replace')}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["256", "256"]


def test_simclr_views_shapes_range_and_seeding(tmp_path):
    spec = load_dataset("imagefolder", photo_tree(tmp_path))
    encoded = EncodedImages(spec.train)
    images = encoded.decode(EncodedBatch([encoded[i] for i in range(len(encoded))]), torch.device("cpu"))
    n = len(images)

    def views(seed):
        return D.simclr_views(images, 40, torch.Generator().manual_seed(seed))

    x = views(0)
    assert x.shape == (2 * n, 3, 40, 40) and x.dtype == torch.float32 and x.isfinite().all()
    pixels = x * torch.tensor(IMAGENET_STD).view(3, 1, 1) + torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5 and 0.2 < pixels.mean() < 0.8
    assert not torch.allclose(x[:n], x[n:])  # two different views of each image
    torch.testing.assert_close(views(0), x, rtol=0, atol=0)
    assert (views(1) - x).abs().amax((1, 2, 3)).min() > 0  # another seed changes every view


def test_corrupt_jpeg_is_the_worker_paths_error_or_skipped_and_logged(tmp_path):
    root = photo_tree(tmp_path)
    bad = truncate(root / "train" / "a" / "3.jpg")
    garbage = root / "train" / "b" / "5.jpg"
    garbage.write_bytes(b"not an image")
    spec = load_dataset("imagefolder", root)
    encoded = EncodedImages(spec.train)
    index = {path: i for i, (path, _) in enumerate(spec.train.samples)}
    assert encoded[index[bad]][0].ndim == 1
    with pytest.raises(UserError) as decoding:
        encoded.decode(EncodedBatch([encoded[0], encoded[index[bad]]]), torch.device("cpu"))
    with pytest.raises(UserError) as worker:
        spec.train[index[bad]]
    assert str(decoding.value) == str(worker.value) and str(bad) in str(worker.value)
    with pytest.raises(UserError, match=str(garbage)):  # not even a header: the worker names it
        encoded[index[garbage]]

    skipping = load_dataset("imagefolder", root, skip_bad=True).train
    skipping.bad_log = tmp_path / "bad_images.txt"
    encoded = EncodedImages(skipping)
    images = encoded.decode(EncodedBatch([encoded[0], encoded[index[bad]], encoded[index[garbage]]]),
                            torch.device("cpu"))
    assert len(images) == 3 and all(image.shape[0] == 3 for image in images)
    assert torch.equal(images[1], TF.pil_to_tensor(spec.train[index[bad] + 1][0]))  # the next file instead
    assert sorted(skipping.bad_files) == sorted([str(bad), str(garbage)])
    assert set(skipping.bad_log.read_text().splitlines()) == {str(bad), str(garbage)}


def _run(tmp_path, name, **kw):
    return Config(dataset="imagefolder", data_dir=str(tmp_path / "data"), encoder="cnn", image_size=40,
                  proj_hidden=16, proj_dim=8, batch_size=4, epochs=2, warmup_epochs=0, workers=0, log_every=1,
                  out=str(tmp_path / name), **{"augment": "device", **kw})


def test_trainer_on_device_views_is_seeded_by_step_and_resumes_exactly(tmp_path):
    photo_tree(tmp_path / "data")
    straight = Trainer(_run(tmp_path, "a"), progress=False)
    assert isinstance(straight.input.views, FileViews) and straight.total_steps == 6  # images of several sizes
    x = next(straight.input.batches(0, 1))
    assert x.shape == (8, 3, 40, 40)
    torch.testing.assert_close(next(straight.input.batches(0, 1)), x, rtol=0, atol=0)
    first = next(iter(straight.input.loader(EpochSampler(len(straight.data.train), 4, seed=0))))
    torch.testing.assert_close(straight.input.views(first, 0), x, rtol=0, atol=0)
    assert not torch.allclose(straight.input.views(first, 1), x)  # the same images at another step
    assert_resume_is_exact(straight, lambda **kw: _run(tmp_path, "b", **kw))


def test_augment_is_chosen_by_device_and_dataset(tmp_path):
    photo_tree(tmp_path / "data")
    assert Trainer(_run(tmp_path, "auto", augment="auto"), progress=False).input.views is None  # CPU: workers
    digits = Trainer(Config(dataset="digits", augment="device", out=str(tmp_path / "digits")), progress=False)
    assert isinstance(digits.input.views, ResidentViews) and digits.input.views.images.shape == (1437, 1, 8, 8)
