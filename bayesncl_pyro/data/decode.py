"""Image files as the training device decodes them (``--augment device``): DataLoader workers read a batch's bytes,
the training process decodes the batch together on its device (nvJPEG on CUDA)."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch
import torchvision
from PIL import Image
from torch.utils.data import Dataset, Subset
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2.functional import pil_to_tensor

from bayesncl_pyro.data.images import image_files, open_rgb
from bayesncl_pyro.errors import UserError


class EncodedImages(Dataset):
    """The files of an image-file split (``ImageFiles``, or a ``Subset`` of one) for batched decoding on the
    training device (``--augment device``).

    DataLoader workers only read: item i is ``(data, j)``, ``j`` the index in ``files`` of the file read (i's,
    or the next readable one when ``skip_bad`` skips it) and ``data`` the file's bytes (1-D uint8) when it is
    a colour JPEG; any other image (PNG, grayscale or CMYK JPEG: rare in photo datasets, and decoded
    differently by nvjpeg) is decoded by the worker as on the worker path, uint8 ``3 x H x W``. The training
    process turns a batch into images with ``decode``. Indices past the length wrap (``EpochSampler``).
    """

    def __init__(self, dataset: Dataset, jpegs_as_bytes: bool = True):
        """``jpegs_as_bytes`` False: the workers decode every image (``nvjpeg_is_safe`` says when to)."""
        self.files = image_files(dataset)
        self.indices = dataset.indices if isinstance(dataset, Subset) else range(len(dataset))
        self.read = _read_encoded if jpegs_as_bytes else _read_decoded
        self.warned = False  # about a batch nvJPEG failed on (decode)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        data, _, j = self.files.read(self.indices[i % len(self)], self.read)
        return data, j

    def decode(self, batch: list[tuple[torch.Tensor, int]], device: torch.device) -> list[torch.Tensor]:
        """Items -> uint8 ``3 x H_i x W_i`` images on ``device``: the JPEGs decoded together there (nvjpeg on
        CUDA). If that fails, the culprits are found by decoding one by one and read again like the worker
        path does (PIL): a file PIL can decode is used, a corrupt one raises the same ``UserError`` naming
        it, or with ``skip_bad`` is skipped and logged alike."""
        # a blocking copy: it waits for the current stream only, which on CUDA is the input pipeline's own
        images = [data.to(device) if data.ndim == 3 else None for data, _ in batch]
        jpegs = [k for k, image in enumerate(images) if image is None]
        decoded, failure = _decode_jpegs([batch[k][0] for k in jpegs], device)
        if failure is not None and device.type == "cuda" and not self.warned:
            self.warned = True
            failed = sum(image is None for image in decoded)
            print(f"warning: nvJPEG failed on a batch of {len(jpegs)} JPEGs ({failure.splitlines()[0]}); they were "
                  f"decoded one at a time, a wait for the GPU each, and the {failed} that failed alone too with PIL "
                  "(a corrupt file does this; should every batch fail, decoding is slow: pass --augment workers). "
                  "Said once", file=sys.stderr, flush=True)
        for k, image in zip(jpegs, decoded, strict=True):
            if image is None:
                image = self.files.read(batch[k][1], _read_decoded)[0].to(device)
            images[k] = image
        return images


def _read_encoded(path: Path) -> torch.Tensor:
    """``EncodedImages``'s item data for one file: its bytes if it is a colour JPEG, else the image."""
    try:
        data = path.read_bytes()
        with Image.open(io.BytesIO(data)) as image:  # reads the header only
            if image.format == "JPEG" and image.mode == "RGB":
                return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    except (OSError, ValueError, Image.DecompressionBombError):
        pass  # open_rgb raises the error that names the file
    return _read_decoded(path)


def _read_decoded(path: Path) -> torch.Tensor:
    return pil_to_tensor(open_rgb(path))


ASYNC_ALLOCATOR_NOTE = ("the cudaMallocAsync allocator backend is selected (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF "
                        "backend:cudaMallocAsync), under which memory that other CUDA streams still use can be handed "
                        "to nvJPEG's outputs")


def nvjpeg_is_safe(device: torch.device) -> bool:
    """Whether the training process may decode JPEGs on ``device`` (``_decode_jpegs``): not on CUDA under the
    cudaMallocAsync backend, whose pool may give the decoding stream a block that another stream frees, with a
    dependency on that stream inserted into the decoding stream only, which nvJPEG's own stream does not follow."""
    return device.type != "cuda" or torch.cuda.get_allocator_backend() == "native"


def _decode_jpegs(encoded: list[torch.Tensor], device: torch.device) -> tuple[list[torch.Tensor | None], str | None]:
    """(``decode_jpeg`` of a list on ``device``, None); if that fails, (the JPEGs decoded one by one, with None for each
    that fails, the batch's error). Running out of memory, or a torchvision that cannot decode on ``device``, raises
    instead: neither is a bad file, and the fallback would hide them.

    On CUDA each decode first waits until the current stream has run all its queued work. torchvision allocates the
    decoded images on the current stream of ``device`` (it switches to ``device`` itself, whatever the calling thread's
    current device), and nvJPEG's hardware decoder writes them from its own stream without waiting for that one; the
    caching allocator hands out a block as soon as it is freed on the stream that owns it, so without the wait nvJPEG
    can overwrite memory that queued kernels still read (NaNs in training at 32 px, wrong pixels). Only blocks of the
    current stream are at risk under the native allocator (other streams' blocks are not handed to it, and a block used
    on another stream via ``record_stream`` comes back only after that use has run), so the wait is on this stream
    alone: the input pipeline's, in its own thread, never the training step's (``pipeline.py``). decode_jpeg waits for
    its own stream before returning anyway, so this moves a wait, and adds none. Under cudaMallocAsync the reasoning
    fails (``nvjpeg_is_safe``): the trainer has the loader workers decode instead.

    A decode that fails part-way may leave nvJPEG's stream writing into outputs torchvision has already freed onto
    the current stream, so after a failure the whole device is waited for, the decoder's stream included, before
    anything is allocated there: a batch that fails costs a wait for the GPU per JPEG and one more per failing one
    (rare for corrupt files; ``EncodedImages.decode`` says once when it happens)."""
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
    """``decode_jpeg`` failed on the data: the failures ``_decode_jpegs`` falls back from."""


def _decode(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``decode_jpeg`` of a non-empty list on ``device`` (``_decode_jpegs``); its failures are ``_Undecodable``,
    except those the fallback must not hide."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    try:
        return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
    except RuntimeError as err:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # before anything allocates where the decoder may still write
        # torchvision turns an out-of-memory error inside the decoder into a RuntimeError saying so
        if isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err):
            raise
        if "not compiled with nvJPEG" in str(err):
            raise UserError(f"this torchvision ({torchvision.__version__}) cannot decode JPEGs on {device} (it was "
                            "built without nvJPEG); install a CUDA build of torchvision, or pass --augment workers") from None
        if "Couldn't load the image extension" in str(err):  # every file would fail: no file is to blame
            raise UserError(f"this torchvision ({torchvision.__version__}) cannot load its image extension, so it "
                            f"decodes no JPEG; install the torchvision build made for torch {torch.__version__}") from None
        raise _Undecodable(str(err)) from None
