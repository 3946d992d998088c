"""Generated photo-like images, for the decoders' benchmark, the GPU check and the tests.

Smooth random colour
with noise, which JPEG compresses about as it does a photograph (a flat colour it would compress to nothing).
"""

import io
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image


def photo(seed: int, size: tuple[int, int] | None = None) -> Image.Image:
    """A photo-like RGB image drawn from ``seed``.

    ``size`` = (width, height), by default drawn from ``seed`` in ImageNet's usual 400-500 x
    300-375 px: random colours on a 16 x 12 grid, upsampled bicubically, with Gaussian noise of sd 12.
    """
    rng = np.random.default_rng(seed)
    if size is None:
        size = (int(rng.integers(400, 501)), int(rng.integers(300, 376)))
    low = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(low).resize(size, Image.BICUBIC), dtype=np.float32)
    return Image.fromarray(np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8))


def _write(job: tuple[Path, int, tuple[int, int] | None]):
    root, i, size = job
    split = "test" if (i // 10) % 50 == 0 else "train"  # every class in both splits, 2 % held out
    path = root / split / f"c{i % 10}" / f"{i}.jpg"
    path.parent.mkdir(parents=True, exist_ok=True)
    photo(i, size).save(path, quality=90)  # 4:2:0 chroma, as most photographs


def write_photo_folder(root: Path, n: int, size: tuple[int, int] | None = None) -> Path:
    """Write an image folder of ``n`` generated JPEGs in 10 classes.

    JPEG quality 90, ``root/{train,test}/c<i % 10>/<i>.jpg`` holding ``photo(i,
    size)``: 10 classes, each in both splits; written by one process per CPU.
    """
    with ProcessPoolExecutor(mp_context=multiprocessing.get_context("fork")) as pool:
        list(pool.map(_write, [(root, i, size) for i in range(n)], chunksize=100))
    return root


def replicated_chroma(jpeg: bytes) -> np.ndarray:
    """A 4:2:0 JPEG decoded with replicated chroma, as nvJPEG's default does.

    Replicated as libjpeg's fast upsampling does; ``H x W x 3`` uint8: the luma at full size, the chroma at its own half
    size (libjpeg's DCT scaling by 1/2 decodes chroma without upsampling it), each chroma pixel repeated 2 x 2, then
    PIL's YCbCr -> RGB. PIL's own decode interpolates the chroma ("fancy" upsampling): the reference a check of a GPU
    decoder tells apart from it.
    """
    full = Image.open(io.BytesIO(jpeg))
    full.draft("YCbCr", full.size)
    half = Image.open(io.BytesIO(jpeg))
    half.draft("YCbCr", (full.size[0] // 2, full.size[1] // 2))
    luma = np.asarray(full)[..., 0]
    chroma = np.asarray(half)[..., 1:].repeat(2, 0).repeat(2, 1)[:luma.shape[0], :luma.shape[1]]
    return np.array(Image.fromarray(np.dstack([luma, chroma]), "YCbCr").convert("RGB"))
