"""Image files decoded in batches on the training device (``--augment device``).

DataLoader workers read a batch's files
into one tensor (``EncodedBatch``), the training process decodes its JPEGs together on its device with the first
installed decoder that works there (``JPEG_DECODERS``): nvImageCodec's (with libjpeg's smooth chroma upsampling, so
its pixels are PIL's), TorchCodec's, torchvision's.

On CUDA nothing here waits for the GPU: the decoders run on a stream of their own (``decode_stream``), and the
caller's stream waits for it with an event (``_on_decode_stream`` says how each decoder's memory is kept safe).
"""

from __future__ import annotations

import collections
import io
import logging
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
import torchvision
from PIL import Image
from torch.utils.data import Dataset, Subset
from torchvision.transforms.v2.functional import pil_to_tensor

from bayesncl_pyro.data.images import image_files, open_rgb
from bayesncl_pyro.errors import UserError

logger = logging.getLogger(__name__)


class EncodedBatch:
    """A batch of ``EncodedImages`` items in one uint8 tensor, as a DataLoader worker sends it.

    Made by ``collate_fn``:
    ``data`` holds each item's data (a JPEG's bytes, or the image the worker decoded) one after another, ``shapes``
    their shapes, ``files`` the index of each item's file. Iterating gives the items back, as views of ``data``.

    A worker sends each tensor of a batch as a shared-memory file of its own, over a file descriptor of its own that
    stays open until the training process has taken the batch. The items' own tensors took one descriptor per image,
    a batch of 256 images 256, and with a few batches in flight from each of several workers the usual limit of 1024
    open files was reached (``RuntimeError: received 0 items of ancdata``); one tensor per batch takes one.
    """

    def __init__(self, items: list[tuple[torch.Tensor, int]]):
        self.shapes = [tuple(data.shape) for data, _ in items]
        self.files = [j for _, j in items]
        self.data = torch.cat([data.reshape(-1) for data, _ in items]) if items else torch.zeros(0, dtype=torch.uint8)

    def __len__(self) -> int:
        return len(self.files)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        start = 0
        for shape, j in zip(self.shapes, self.files, strict=True):
            end = start + math.prod(shape)
            yield self.data[start:end].view(shape), j
            start = end


class EncodedImages(Dataset):
    """The files of an image-file split, read for batched decoding on the training device.

    The split is an ``ImageFiles``, or a ``Subset`` of one; used with ``--augment device``.

    DataLoader workers only read: item i is ``(data, j)``, ``j`` the index in ``files`` of the file read (i's,
    or the next readable one when ``skip_bad`` skips it) and ``data`` the file's bytes (1-D uint8) when it is
    a colour JPEG without an EXIF rotation; any other image (PNG, grayscale or CMYK JPEG, a rotated JPEG: rare in
    photo datasets, and decoded differently by the JPEG decoders) is decoded by the worker as on the worker path,
    uint8 ``3 x H x W``. A batch travels as one ``EncodedBatch`` (pass it as ``collate_fn``); the training process
    turns it into images with ``decode``. Indices past the length wrap (``EpochSampler``).
    """

    def __init__(self, dataset: Dataset, jpegs_as_bytes: bool = True):
        """``jpegs_as_bytes`` False: the workers decode every image (where ``no_jpeg_decoder`` says why)."""
        self.files = image_files(dataset)
        self.indices = dataset.indices if isinstance(dataset, Subset) else range(len(dataset))
        self.read = _read_encoded if jpegs_as_bytes else _read_decoded
        self.warned = False  # about a batch nvJPEG failed on (decode)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        data, _, j = self.files.read(self.indices[i % len(self)], self.read)
        return data, j

    def decode(self, batch: EncodedBatch, device: torch.device) -> list[torch.Tensor]:
        """Decode a batch into uint8 ``3 x H_i x W_i`` images on ``device``.

        The JPEGs are decoded together there (nvJPEG on
        CUDA). If that fails, the culprits are found by decoding one by one and read again like the worker
        path does (PIL): a file PIL can decode is used, a corrupt one raises the same ``UserError`` naming
        it, or with ``skip_bad`` is skipped and logged alike.
        """
        items = list(batch)
        images = [_to_device(data, device) if data.ndim == 3 else None for data, _ in items]
        jpegs = [k for k, image in enumerate(images) if image is None]
        decoded, failure = _decode_jpegs([items[k][0] for k in jpegs], device)
        if failure is not None and device.type == "cuda" and not self.warned:
            self.warned = True
            failed = sum(image is None for image in decoded)
            logger.warning(f"warning: nvJPEG failed on a batch of {len(jpegs)} JPEGs ({failure.splitlines()[0]}); "
                           f"they were decoded one at a time, a wait for the GPU each, and the {failed} that failed "
                           "alone too with PIL (a corrupt file does this; should every batch fail, decoding is slow: "
                           "pass --augment workers). Said once")
        for k, image in zip(jpegs, decoded, strict=True):
            if image is None:
                image = self.files.read(items[k][1], _read_decoded)[0].to(device)
            images[k] = image
        return images


_ORIENTATION = 0x0112  # the EXIF tag of the rotation a viewer applies; PIL, like the worker path, ignores it


def _read_encoded(path: Path) -> torch.Tensor:
    """``EncodedImages``'s item data for one file: its JPEG bytes, or the decoded image.

    The bytes if it is a colour JPEG without an EXIF rotation (TorchCodec
    applies one, where the worker path does not), else the image.
    """
    try:
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as image:  # reads the header only
            if image.format == "JPEG" and image.mode == "RGB" and image.getexif().get(_ORIENTATION, 1) == 1:
                return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    except (OSError, ValueError, Image.DecompressionBombError):
        pass  # open_rgb raises the error that names the file
    return _read_decoded(path)


def _read_decoded(path: Path) -> torch.Tensor:
    return pil_to_tensor(open_rgb(path))


def _to_device(image: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a worker-decoded image to ``device`` without waiting for the copy.

    On CUDA from pinned memory, so the copy is queued, not waited for (the
    caching host allocator keeps that memory until the copy has run).
    """
    return image.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else image.to(device)


class JpegDecoder(NamedTuple):
    """A library's batched JPEG decoder.

    ``decode(jpegs, device)``: a list of 1-D uint8 CPU tensors -> their RGB images, uint8
    ``3 x H x W`` on ``device``, decoded in one call (on CUDA, by nvJPEG in batches, on the current stream's device).
    """

    name: str  # the library and its version
    decode: Callable[[list[torch.Tensor], torch.device], list[torch.Tensor]]
    # on CUDA the images are PyTorch's memory, allocated on the current stream and written from a stream of the
    # library's own (TorchCodec, torchvision); else the library's own memory, written in the current stream's order
    # (nvImageCodec)
    torch_memory: bool


def _installed_decoders() -> list[JpegDecoder]:
    """The JPEG decoders installed, preferred first.

    nvImageCodec's (smooth chroma upsampling, as PIL's libjpeg),
    TorchCodec's (from 0.16), to which torchvision's moved, then torchvision's (deprecated by torchvision 0.29, to be
    removed). TorchCodec's writes from a stream of its own whatever its version says (0.17 does).
    """
    found = []
    try:
        from nvidia import nvimgcodec  # late: each decoder is optional, looked for when asked
    except (ImportError, OSError, RuntimeError):
        pass
    else:
        found.append(JpegDecoder(f"nvImageCodec {nvimgcodec.__version__}", _NvImageCodec(nvimgcodec), False))
    try:
        import torchcodec  # late: as above
        from torchcodec.decoders import decode_jpeg as codec_decode  # late: as above
    except (ImportError, OSError, RuntimeError):  # missing, older than 0.16, or its libraries do not load here
        pass
    else:
        found.append(JpegDecoder(f"TorchCodec {torchcodec.__version__}",
                                 lambda jpegs, device: codec_decode(jpegs, mode="RGB", device=device), True))
    try:
        from torchvision.io import ImageReadMode  # late: as above
        from torchvision.io import decode_jpeg as vision_decode  # late: as above
    except ImportError:
        pass
    else:
        found.append(JpegDecoder(f"torchvision {torchvision.__version__}",
                                 lambda jpegs, device: vision_decode(jpegs, mode=ImageReadMode.RGB, device=device),
                                 True))
    return found


class _NvImageCodec:
    """nvImageCodec's batched JPEG decode, with PIL's chroma upsampling.

    Planar RGB, EXIF rotations not applied (as PIL, the worker path's reader), and
    ``fancy_upsampling``: 4:2:0 chroma interpolated as libjpeg does (nvJPEG's default replicates it, whose
    pixels differ from PIL's). On CUDA in the current stream's order; a JPEG it cannot decode fails the
    batch (``_decode_jpegs`` then finds which). It answers None for an image whether the file is bad or it cannot
    decode on the device at all (0.9 without a GPU: 'Unable to get device count'), so a failed batch is told apart by a
    JPEG known to be good: failing too, it raises what ``_decode`` takes for a decoder that cannot work there.
    """

    def __init__(self, nvimgcodec):
        self.nvimgcodec, self.decoders = nvimgcodec, {}
        self.params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
                                              sample_format=nvimgcodec.SampleFormat.P_RGB)

    def __call__(self, jpegs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        images = self._decode(jpegs, device)
        failed = [k for k, image in enumerate(images) if image is None]
        if failed:
            if self._decode([_good_jpeg()], device)[0] is None:
                raise RuntimeError(f"it fails on a known-good JPEG too ({len(failed)} of {len(jpegs)} failed)")
            raise RuntimeError(f"nvImageCodec could not decode {len(failed)} of {len(jpegs)} JPEGs")
        return [torch.from_dlpack(image) for image in images]

    def _decode(self, jpegs: list[torch.Tensor], device: torch.device) -> list:
        codec = self.nvimgcodec
        cuda = device.type == "cuda"
        index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
        if index not in self.decoders:
            self.decoders[index] = codec.Decoder(device_id=index if cuda else codec.NVIMGCODEC_DEVICE_CPU_ONLY,
                                                 options=":fancy_upsampling=1")
        stream = torch.cuda.current_stream(device).cuda_stream if cuda else 0
        return self.decoders[index].decode([codec.CodeStream(data.numpy()) for data in jpegs], params=self.params,
                                           cuda_stream=stream)


def _good_jpeg() -> torch.Tensor:
    """A small colour JPEG that any JPEG decoder decodes (PIL's, 4:2:0)."""
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 80, 30)).save(buffer, "JPEG")
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


JPEG_DECODERS = _installed_decoders()
_CANNOT = {}  # (device, decoder name) -> why that decoder cannot decode on that device (_decode)

_ASYNC_ALLOCATOR_NOTE = ("the cudaMallocAsync allocator backend is selected (PYTORCH_CUDA_ALLOC_CONF or "
                        "PYTORCH_ALLOC_CONF backend:cudaMallocAsync), under which memory that other CUDA streams "
                        "still use can be handed to the outputs of its nvJPEG decoder, which writes them from a "
                        "stream of its own")


def jpeg_decoders(device: torch.device) -> list[JpegDecoder]:
    """The decoders that may decode JPEGs on ``device``, preferred first.

    Those installed, less any found unable to
    there (``_decode``), and on CUDA under the cudaMallocAsync backend less those that write PyTorch's memory from a
    stream of their own: that backend's pool may give the decoding stream a block that another stream frees, with a
    dependency on that stream inserted into the decoding stream only, which the decoder's own stream does not
    follow.
    """
    async_pool = device.type == "cuda" and torch.cuda.get_allocator_backend() != "native"
    return [d for d in JPEG_DECODERS if (device, d.name) not in _CANNOT and not (async_pool and d.torch_memory)]


def no_jpeg_decoder(device: torch.device) -> str | None:
    """Why no JPEG can be decoded in the training process on ``device``, or None when one can.

    When none can, the loader workers decode the JPEGs.
    """
    if jpeg_decoders(device):
        return None
    if not JPEG_DECODERS:
        return "no JPEG decoder is installed (nvImageCodec, TorchCodec, or torchvision before it removes its own)"
    return "; ".join(f"{d.name} cannot decode JPEGs on {device}: {_CANNOT[device, d.name]}"
                     if (device, d.name) in _CANNOT else f"{d.name}: {_ASYNC_ALLOCATOR_NOTE}" for d in JPEG_DECODERS)


def _decode_jpegs(encoded: list[torch.Tensor], device: torch.device) -> tuple[list[torch.Tensor | None], str | None]:
    """Decode JPEGs together on ``device``, one by one if that fails.

    Returns (the JPEGs decoded together on ``device``, None); if that fails, (the JPEGs decoded one by one, with None
    for each that fails, the batch's error). Running out of memory, and a decoder that cannot decode on ``device`` when
    no other can, raise instead: neither is a bad file, and the fallback would hide them.

    A decode that fails part-way may leave nvJPEG writing into outputs the decoder has already freed (torchvision's,
    from its own stream), so after a failure the whole device is waited for before anything is allocated there: a
    batch that fails costs a wait for the GPU per JPEG and one more per failing one (rare for corrupt files;
    ``EncodedImages.decode`` says once when it happens).
    """
    if not encoded:
        return [], None
    try:
        return _decode(encoded, device), None
    except _Undecodable as err:
        failure = str(err)
    images = []
    for data in encoded:
        try:
            images.append(_decode([data], device)[0])
        except _Undecodable:
            images.append(None)
    return images, failure


class _Undecodable(Exception):
    """The decoder failed on the data: the failures ``_decode_jpegs`` falls back from."""


# decoders that cannot work on the device at all, whatever the file: a build without nvJPEG, or nvJPEG that does not
# start (TorchCodec's nvJPEG is CUDA 13's, which a driver too old for it refuses); torchvision's image extension;
# nvImageCodec failing on a known-good JPEG (_NvImageCodec)
_CANNOT_DECODE_HERE = re.compile(r"not compiled with nvJPEG|Failed to initialize nvjpeg|Couldn't load the image "
                                 "extension|fails on a known-good JPEG", re.IGNORECASE)
# nvJPEG's own allocation failures carry a status code, not "out of memory": NVJPEG_STATUS_ALLOCATOR_FAILURE (5) after
# an nvJPEG call, cudaErrorMemoryAllocation (2) after a CUDA call (both libraries end such messages ": <code>")
_ALLOCATION_FAILURE = re.compile(r"(?<!CUDA stream): 5$|CUDA stream: 2$", re.MULTILINE)
# a torch call inside a stable-ABI extension (TorchCodec) that failed: before torch 2.13 the stable ABI drops the
# original message, so an out-of-memory error inside TorchCodec reads only so; it never means a bad file
_TORCH_CALL_FAILED = "API call failed at"


def _decode(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Decode ``encoded`` on ``device`` with the first decoder that works there.

    ``encoded`` is a non-empty list; the decoders are ``jpeg_decoders(device)``'s (``_decode_jpegs``), run on CUDA on
    the decoding stream (``_on_decode_stream``); its failures on the data are ``_Undecodable``.
    """
    for decoder in jpeg_decoders(device):
        try:
            return _on_decode_stream(decoder, encoded, device) if device.type == "cuda" else decoder.decode(encoded,
                                                                                                             device)
        except RuntimeError as err:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # before anything allocates where the decoder may still write
            message = str(err)
            # torchvision turns an out-of-memory error inside the decoder into a RuntimeError saying so
            if isinstance(err, torch.OutOfMemoryError) or "out of memory" in message:
                raise
            if _ALLOCATION_FAILURE.search(message):
                raise torch.OutOfMemoryError(
                    f"{decoder.name}: nvJPEG could not allocate memory on {device} to decode {len(encoded)} JPEGs "
                    f"({message.splitlines()[-1]}: an allocation failure); lower --batch-size, or pass --augment "
                    "workers") from None
            if _TORCH_CALL_FAILED in message:
                raise RuntimeError(
                    f"{decoder.name}: a torch call inside the decoder failed on {device} ({message.splitlines()[0]}); "
                    f"under torch {torch.__version__} an out-of-memory error there reads so: lower --batch-size, or "
                    "pass --augment workers") from err
            if not _CANNOT_DECODE_HERE.search(message):
                raise _Undecodable(message) from None
            _CANNOT[device, decoder.name] = message.splitlines()[0]
            if jpeg_decoders(device):
                logger.info(f"note: {decoder.name} cannot decode JPEGs on {device} ({_CANNOT[device, decoder.name]}); "
                            f"{jpeg_decoders(device)[0].name} decodes them instead")
    raise UserError(f"{no_jpeg_decoder(device)}; install nvImageCodec (nvidia-nvimgcodec-cu13 and nvidia-nvjpeg), or a "
                    f"TorchCodec (or torchvision) build made for torch {torch.__version__} with nvJPEG, or pass "
                    "--augment workers")


_DECODE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_HELD: collections.deque = collections.deque()  # (event, images): a library's memory, released once the GPU passes
HELD_BATCHES = 2
"""Batches of a library's own decoded memory kept before the host waits for the oldest to be copied out."""


def decode_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream JPEGs are decoded on, one per device: nothing else runs on it."""
    if device not in _DECODE_STREAMS:
        _DECODE_STREAMS[device] = torch.cuda.Stream(device)
    return _DECODE_STREAMS[device]


def _on_decode_stream(decoder: JpegDecoder, encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Run ``decoder`` on the decoding stream and hand its images to the caller's stream.

    The decoding stream is ``decode_stream(device)``; the caller's current stream waits for the decoding stream with an
    event (on the GPU; the host waits for nothing).

    The race this avoids (seen on the GPU machine: NaNs in training, decoded pixels off by up to 85/255):
    TorchCodec's and torchvision's nvJPEG allocate their images on the current stream and write them from a stream
    of their own, which waits for nothing; the caching allocator hands a block to that stream's next allocation as
    soon as it is freed there, so the decoder could overwrite memory that queued kernels of the current stream still
    read. Here the current stream is the decoding stream, on which no kernel ever runs, and the caller's stream marks
    the images as its own (``record_stream``): a block of theirs goes back to the decoding stream only after the
    caller's uses of it have run. nvImageCodec writes memory of its own in the decoding stream's order: its images are
    copied into PyTorch's memory on the caller's stream and kept (``_HELD``) until the GPU has passed that copy
    (an event the host queries; past ``HELD_BATCHES`` batches it waits for the oldest).
    """
    caller, stream = torch.cuda.current_stream(device), decode_stream(device)
    with torch.cuda.stream(stream):
        images = decoder.decode(encoded, device)
    caller.wait_stream(stream)
    if decoder.torch_memory:
        for image in images:
            image.record_stream(caller)
        return images
    owned = [image.clone() for image in images]
    _HELD.append((caller.record_event(), images))
    while _HELD:
        event, _ = _HELD[0]
        if not event.query():
            if len(_HELD) <= HELD_BATCHES:
                break
            event.synchronize()
        _HELD.popleft()
    return owned
