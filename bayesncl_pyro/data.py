"""Datasets: digits, CIFAR-10/100, any ImageFolder tree and ImageNet-100, all read from local files.

Nothing here downloads: the machines this runs on are offline, so every dataset except the
scikit-learn digits (bundled in its wheel) is read from a folder the user points at, and every
layout problem is reported as a one-line ``UserError`` naming the expected layout.

Items are ``(image, label)`` with ``image`` either a PIL RGB image (image files) or a uint8
tensor ``C x H x W`` (digits, CIFAR pickles); ``bayesncl_pyro.augment`` accepts both.
"""

from __future__ import annotations

import importlib.resources
import io
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Subset
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms.v2.functional import pil_to_tensor

from bayesncl_pyro.errors import UserError

DATASETS: tuple[str, ...] = ("digits", "cifar10", "cifar100", "imagefolder", "in100", "compositional")

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"})

# Held-out split folder names, in the order they are looked for.
_HELD_OUT_SPLITS = ("val", "test")


@dataclass
class DataSpec:
    """A dataset's two splits plus what a model needs to know about its images."""

    train: Dataset  # items (image, label: int)
    test: Dataset  # the held-out split (test or val)
    classes: list[str]  # class names, index = label
    channels: int  # 1 for digits, else 3

    @property
    def num_classes(self) -> int:
        return len(self.classes)


class TensorImages(Dataset):
    """In-memory images: ``images`` uint8 ``N x C x H x W``, ``labels`` ``N`` ints.

    ``factors`` (generated data only): the ground-truth generative factors, name -> ``N`` long tensor.
    """

    def __init__(self, images: torch.Tensor, labels: list[int], factors: dict[str, torch.Tensor] | None = None):
        assert images.dtype == torch.uint8 and images.ndim == 4 and len(images) == len(labels)
        assert all(len(v) == len(labels) for v in (factors or {}).values())
        self.images = images
        self.labels = [int(y) for y in labels]
        self.factors = factors

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], self.labels[i]


class ImageFiles(Dataset):
    """Image files on disk, opened lazily as RGB PIL images.

    ``samples`` is a list of ``(path, label)``. With ``skip_bad`` an unreadable file is replaced
    by the next readable one (a long run can survive a few corrupt files in a big dataset) and
    recorded in ``bad_files``; without it, it raises ``UserError`` naming the file. ``bad_files``
    is per process, so with DataLoader workers it only sees the main process's reads; set ``bad_log``
    to a file and every process appends each file it skips to it, one path per line.
    """

    def __init__(self, samples: list[tuple[Path, int]], skip_bad: bool = False):
        self.samples = samples
        self.skip_bad = skip_bad
        self.bad_files: list[str] = []
        self.bad_log: Path | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Image.Image, int]:
        image, label, _ = self.read(i, _open_rgb)
        return image, label

    def read(self, i: int, opener: Callable[[Path], Any]) -> tuple[Any, int, int]:
        """``(opener(path), label, j)`` of file ``j = i``, or with ``skip_bad`` of the first file from i on
        (cyclically) that ``opener`` reads without a ``UserError``, the ones before it recorded as bad."""
        n = len(self.samples)
        if not -n <= i < n:
            raise IndexError(i)  # also ends plain `for item in dataset` iteration
        for j in range(i, i + n):
            path, label = self.samples[j % n]
            try:
                return opener(path), label, j % n
            except UserError:
                if not self.skip_bad:
                    raise
                if str(path) not in self.bad_files:
                    self.bad_files.append(str(path))
                    if self.bad_log is not None:
                        with open(self.bad_log, "a") as log:  # one short append: whole lines across processes
                            log.write(f"{path}\n")
        raise UserError(f"none of the {n} images could be read (first bad file: {self.bad_files[0]}); check the data folder")


def _open_rgb(path: Path) -> Image.Image:
    try:
        with Image.open(path) as image:
            # load() decodes in full here, so truncation surfaces now, with the path; an RGB image is
            # returned as decoded (convert() would copy it)
            image.load()
            return image if image.mode == "RGB" else image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise UserError(f"cannot read image {path} ({err}); delete or replace it, or skip such files with --skip-bad-images (skip_bad=True)") from None


def image_files(dataset: Dataset) -> ImageFiles | None:
    """The ``ImageFiles`` a split reads (through a ``train_subset``), or None for in-memory images."""
    files = dataset.dataset if isinstance(dataset, Subset) else dataset
    return files if isinstance(files, ImageFiles) else None


class EncodedImages(Dataset):
    """The files of an image-file split (``ImageFiles``, or a ``Subset`` of one) for batched decoding on the
    training device (``--augment device``).

    DataLoader workers only read: item i is ``(data, j)``, ``j`` the index in ``files`` of the file read (i's,
    or the next readable one when ``skip_bad`` skips it) and ``data`` the file's bytes (1-D uint8) when it is
    a colour JPEG; any other image (PNG, grayscale or CMYK JPEG: rare in photo datasets, and decoded
    differently by nvjpeg) is decoded by the worker as on the worker path, uint8 ``3 x H x W``. The training
    process turns a batch into images with ``decode``. Indices past the length wrap (``EpochSampler``).
    """

    def __init__(self, dataset: Dataset):
        self.files = image_files(dataset)
        self.indices = dataset.indices if isinstance(dataset, Subset) else range(len(dataset))

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        data, _, j = self.files.read(self.indices[i % len(self)], _read_encoded)
        return data, j

    def decode(self, batch: list[tuple[torch.Tensor, int]], device: torch.device) -> list[torch.Tensor]:
        """Items -> uint8 ``3 x H_i x W_i`` images on ``device``: the JPEGs decoded together there (nvjpeg on
        CUDA). If that fails, the culprits are found by decoding one by one and read again like the worker
        path does (PIL): a file PIL can decode is used, a corrupt one raises the same ``UserError`` naming
        it, or with ``skip_bad`` is skipped and logged alike."""
        # a blocking copy: it waits for the current stream only, which on CUDA is the input pipeline's own
        images = [data.to(device) if data.ndim == 3 else None for data, _ in batch]
        jpegs = [k for k, image in enumerate(images) if image is None]
        for k, image in zip(jpegs, _decode_jpegs([batch[k][0] for k in jpegs], device), strict=True):
            if image is None:
                image = pil_to_tensor(self.files.read(batch[k][1], _open_rgb)[0]).to(device)
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
        pass  # _open_rgb raises the error that names the file
    return pil_to_tensor(_open_rgb(path))


def _decode_jpegs(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """``decode_jpeg`` of a list on ``device``; if that fails, one by one, with None for each that fails.

    On CUDA this first waits until the current stream has run all its queued work. torchvision allocates the
    decoded images on the current stream, and nvJPEG's hardware decoder writes them from its own stream
    without waiting for that one (pytorch/vision#9606, meta-pytorch/torchcodec#1634); the caching allocator
    hands out a block as soon as it is freed on the stream that owns it, so without the wait nvJPEG can
    overwrite memory that queued kernels still read (NaNs in training at 32 px, wrong pixels). Only blocks
    of the current stream are at risk (other streams' blocks are not handed to it, and a block used on
    another stream via ``record_stream`` comes back only after that use has run), so the wait is on this
    stream alone: the input pipeline's, in its own thread, never the training step's (``pipeline.py``).
    decode_jpeg waits for its own stream before returning anyway, so this moves a wait, and adds none."""
    if encoded and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    try:
        return decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device) if encoded else []
    except RuntimeError:
        return [None] if len(encoded) == 1 else [image for data in encoded for image in _decode_jpegs([data], device)]


RESIDENT_MEMORY_SHARE = 0.25
"""The most of the training device's free memory a training set may take to be held there (``resident_images``)."""


def resident_images(dataset: Dataset, device: torch.device, workers: int = 0) -> torch.Tensor | None:
    """The training split as one uint8 ``N x C x H x W`` tensor on ``device`` (row i = item i), or None when it
    should be read per batch instead: its images differ in size, or they would take more than
    ``RESIDENT_MEMORY_SHARE`` of the device's free memory (``free_memory``).

    In-memory splits (digits, CIFAR pickles, compositional) are copied over. Image files are decoded once,
    here, with PIL in ``workers`` DataLoader processes (the worker path's reader: the same pixels, and
    ``skip_bad`` replaces an unreadable file by the next readable one alike); the size of the first image
    decides whether that is tried at all, so an ImageNet folder costs one file read. CIFAR as 32 px JPEGs
    is 150 MB and decodes in seconds; nothing is decoded per step, nvJPEG included."""
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
    batches = list(loader)
    return None if any(b is None for b in batches) else torch.cat(batches).to(device)


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


def load_dataset(
    name: str, data_dir: str | os.PathLike | None = None, *, seed: int = 0, skip_bad: bool = False,
    train_subset: int | None = None,
) -> DataSpec:
    """Load ``name`` (one of ``DATASETS``) from ``data_dir``.

    ``seed`` fixes the digits train/test split and the generated compositional images (the other
    datasets have official splits), and which images a ``train_subset`` keeps.
    ``skip_bad`` makes image-file datasets skip unreadable files instead of raising.
    ``train_subset``: keep only this many training images, drawn at random (the test split is kept whole).
    """
    spec = _load(name, data_dir, seed, skip_bad)
    if train_subset is not None:
        if not 0 < train_subset <= len(spec.train):
            raise UserError(f"--train-subset must lie in [1, {len(spec.train)}] (the size of {name}'s training "
                            f"split), got {train_subset}")
        keep = torch.randperm(len(spec.train), generator=torch.Generator().manual_seed(seed))[:train_subset]
        spec.train = Subset(spec.train, keep.tolist())
    return spec


def _load(name: str, data_dir: str | os.PathLike | None, seed: int, skip_bad: bool) -> DataSpec:
    if name not in DATASETS:
        raise UserError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    if name == "digits":
        return _load_digits(seed)
    if name == "compositional":
        return load_compositional(seed)
    root = _existing_dir(name, data_dir)
    if name in ("cifar10", "cifar100"):
        return _load_cifar(name, root, skip_bad)
    if name == "in100":
        return _load_in100(root, skip_bad)
    return _load_image_folder(root, skip_bad=skip_bad)


_EXPECTED_LAYOUT = {
    "cifar10": "cifar-10-batches-py/ (or its parent), or an ImageFolder tree with train/ and test/ class folders",
    "cifar100": "cifar-100-python/ (or its parent), or an ImageFolder tree with train/ and test/ class folders",
    "imagefolder": "a folder holding train/ and val/ (or test/), each with one sub-folder of images per class",
    "in100": "an ImageNet or ImageNet-100 folder holding train/<wnid>/ and val/<wnid>/ class folders",
}


def _existing_dir(name: str, data_dir: str | os.PathLike | None) -> Path:
    if data_dir is None:
        raise UserError(f"dataset {name!r} needs a data directory (--data-dir): {_EXPECTED_LAYOUT[name]}")
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise UserError(f"data directory {root} does not exist; for {name!r} pass {_EXPECTED_LAYOUT[name]}")
    return root


# --------------------------------------------------------------------------------------------- digits


def _load_digits(seed: int) -> DataSpec:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    # Pixel values are counts 0..16; stretch them to the uint8 range real images use.
    images = torch.from_numpy(np.round(digits.images * (255 / 16)).astype(np.uint8)).unsqueeze(1)
    labels = digits.target.tolist()
    train_idx, test_idx = train_test_split(
        np.arange(len(labels)), test_size=0.2, random_state=seed, stratify=labels
    )

    def split(idx: np.ndarray) -> TensorImages:
        return TensorImages(images[idx], [labels[i] for i in idx])

    classes = [str(c) for c in digits.target_names]
    return DataSpec(split(train_idx), split(test_idx), classes, channels=1)


# --------------------------------------------------------------------------------------- compositional

SHAPES = ("disk", "square", "triangle", "ring", "plus", "diamond", "bars", "checker")
"""The classes of the compositional benchmark: the foreground shape (its colour, size and place are random)."""

BACKGROUNDS = ("sky", "grass", "sand", "wall")
"""Its nuisance factor: a textured background shared by every class, independent of the class."""

COMPOSITIONAL_SIZES = dict(train=125, test=40)
"""Images per (shape, background) cell of each split: 4000 train and 1280 test images."""

_BG_COLORS = np.array([[(0.35, 0.6, 0.95), (0.85, 0.92, 1.0)], [(0.15, 0.45, 0.1), (0.35, 0.7, 0.2)],
                       [(0.85, 0.7, 0.4), (0.95, 0.85, 0.6)], [(0.45, 0.45, 0.45), (0.7, 0.7, 0.7)]])


def load_compositional(seed: int, size: int = 32) -> DataSpec:
    """The generated "blue sky" benchmark: one of ``SHAPES`` (the class) drawn on one of ``BACKGROUNDS``.

    Every (shape, background) pair has ``COMPOSITIONAL_SIZES[split]`` images, so the background says
    nothing about the class. Both factors are recorded per image in ``dataset.factors``
    (``{"class": N, "background": N}`` long tensors). Deterministic given ``seed``.
    """
    splits = [_compositional_split(np.random.default_rng([seed, i]), n, size)
              for i, n in enumerate(COMPOSITIONAL_SIZES.values())]
    return DataSpec(*splits, classes=list(SHAPES), channels=3)


def _compositional_split(rng: np.random.Generator, per_cell: int, size: int) -> TensorImages:
    cells = [(c, b) for c in range(len(SHAPES)) for b in range(len(BACKGROUNDS))] * per_cell
    cells = [cells[i] for i in rng.permutation(len(cells))]
    images = np.stack([_compose(rng, c, b, size) for c, b in cells])
    images = torch.from_numpy(np.round(images * 255).astype(np.uint8)).permute(0, 3, 1, 2).contiguous()
    shape, background = torch.tensor(cells).T
    return TensorImages(images, shape.tolist(), factors={"class": shape, "background": background})


def _compose(rng: np.random.Generator, shape: int, background: int, size: int) -> np.ndarray:
    """One ``size x size x 3`` float image in [0, 1]."""
    y, x = np.mgrid[0:size, 0:size] / size
    phase = rng.uniform(0, 2 * np.pi)
    # each background: a two-colour blend driven by its own texture
    texture = [y, 0.5 + 0.5 * np.sin(40 * y + phase), rng.uniform(size=(size, size)),
               0.5 + 0.5 * np.sign(np.sin(25 * (x + y) + phase))][background]
    low, high = _BG_COLORS[background] * rng.uniform(0.85, 1.15)
    image = low + (high - low) * texture[..., None]
    r = rng.uniform(0.22, 0.34) * size
    cy, cx = rng.uniform(r, size - r, size=2)
    dy, dx = (np.mgrid[0:size, 0:size] + 0.5 - np.array([cy, cx])[:, None, None]) / r
    mask = _shape_mask(shape, dx, dy)
    image[mask] = rng.uniform(0, 1, size=3)
    return np.clip(image + rng.normal(0, 0.03, size=image.shape), 0, 1)


def _shape_mask(shape: int, dx: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """Boolean mask of ``SHAPES[shape]`` on offsets ``dx, dy`` from its centre, in units of its radius."""
    dist, box = np.hypot(dx, dy), np.maximum(abs(dx), abs(dy))
    return [
        dist <= 1,
        box <= 0.8,
        (dy <= 0.8) & (abs(dx) <= (dy + 1) * 0.6),
        (dist <= 1) & (dist >= 0.55),
        ((abs(dx) <= 0.3) | (abs(dy) <= 0.3)) & (box <= 1),
        abs(dx) + abs(dy) <= 1,
        (box <= 0.9) & (np.floor((dy + 0.9) / 0.36) % 2 == 0),
        (box <= 0.9) & ((dx > 0) ^ (dy > 0)),
    ][shape]


# ---------------------------------------------------------------------------------------------- CIFAR

# Per dataset: pickle folder name, train files, test files, meta file, label key, class-name key.
_CIFAR_PICKLES = {
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"],
                "batches.meta", "labels", "label_names"),
    "cifar100": ("cifar-100-python", ["train"], ["test"], "meta", "fine_labels", "fine_label_names"),
}


def _load_cifar(name: str, root: Path, skip_bad: bool) -> DataSpec:
    folder, train_files, test_files, meta_file, label_key, names_key = _CIFAR_PICKLES[name]
    num_classes = 10 if name == "cifar10" else 100
    for candidate in (root, root / folder):
        if (candidate / meta_file).is_file():
            classes = [c.decode() for c in _unpickle(candidate / meta_file)[names_key]]
            train = _cifar_pickles([candidate / f for f in train_files], label_key)
            test = _cifar_pickles([candidate / f for f in test_files], label_key)
            return DataSpec(train, test, classes, channels=3)
    if (root / "train").is_dir():
        spec = _load_image_folder(root, skip_bad=skip_bad)
        if spec.num_classes != num_classes:
            raise UserError(f"{root} holds {spec.num_classes} class folders but {name} has {num_classes}; "
                            f"point data_dir at a {name} folder")
        return spec
    raise UserError(f"{root} is not a {name} folder: expected {_EXPECTED_LAYOUT[name]}")


def _unpickle(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"missing CIFAR file {path}; re-extract the official python-version archive")
    # The official files are Python 2 pickles: keys and class names come back as bytes.
    with open(path, "rb") as f:
        return {k.decode(): v for k, v in pickle.load(f, encoding="bytes").items()}


def _cifar_pickles(paths: list[Path], label_key: str) -> TensorImages:
    batches = [_unpickle(p) for p in paths]
    # Rows are 3072 bytes: the 1024 red pixels row-major, then green, then blue.
    images = np.concatenate([np.asarray(b["data"], dtype=np.uint8) for b in batches]).reshape(-1, 3, 32, 32)
    labels = [y for b in batches for y in b[label_key]]
    return TensorImages(torch.from_numpy(images), labels)


# ------------------------------------------------------------------------------------- image folders


def _load_image_folder(root: Path, skip_bad: bool) -> DataSpec:
    present = [s for s in _HELD_OUT_SPLITS if (root / s).is_dir()]
    if not (root / "train").is_dir() or len(present) != 1:
        found = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise UserError(f"{root} should hold train/ and exactly one of val/ or test/ (found folders: {found or 'none'})")
    train = _scan_split(root / "train")
    test = _scan_split(root / present[0])
    if train.keys() != test.keys():
        only_train, only_test = sorted(train.keys() - test.keys()), sorted(test.keys() - train.keys())
        raise UserError(f"train/ and {present[0]}/ class folders differ: only in train {_few(only_train)}, "
                        f"only in {present[0]} {_few(only_test)}; both splits need the same classes")
    classes = sorted(train)
    return DataSpec(_files_dataset(train, classes, skip_bad), _files_dataset(test, classes, skip_bad),
                    classes, channels=3)


def _class_dirs(split_dir: Path) -> list[Path]:
    """Class sub-folders of ``split_dir``, sorted; hidden folders (.ipynb_checkpoints...) skipped."""
    return sorted(p for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def _has_loose_images(split_dir: Path) -> bool:
    return any(p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS for p in split_dir.iterdir())


def _scan_split(split_dir: Path, classes: list[str] | None = None) -> dict[str, list[Path]]:
    """Map class name -> sorted image paths under ``split_dir/<class>/`` (searched recursively).

    ``classes`` restricts the scan to those folders, which must all exist.
    """
    if classes is None:
        dirs = _class_dirs(split_dir)
        if not dirs:
            raise UserError(f"{split_dir} has no class folders; expected {split_dir}/<class>/<images>")
    else:
        dirs = [split_dir / c for c in classes]
    found = {}
    for d in dirs:
        images = sorted(p for p in d.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        if not images:
            raise UserError(f"class folder {d} holds no images ({', '.join(sorted(IMAGE_EXTENSIONS))}); "
                            "add images or remove the folder")
        found[d.name] = images
    return found


def _files_dataset(split: dict[str, list[Path]], classes: list[str], skip_bad: bool) -> ImageFiles:
    return ImageFiles([(p, label) for label, c in enumerate(classes) for p in split[c]], skip_bad=skip_bad)


def _few(names: list[str], n: int = 5) -> str:
    shown = ", ".join(names[:n]) or "none"
    return shown + (f" (+{len(names) - n} more)" if len(names) > n else "")


# ---------------------------------------------------------------------------------------- ImageNet-100


def imagenet100_classes() -> list[str]:
    """The 100 WordNet ids of the standard ImageNet-100 subset (CMC's list), in file order."""
    text = importlib.resources.files("bayesncl_pyro").joinpath("imagenet100_classes.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


def _load_in100(root: Path, skip_bad: bool) -> DataSpec:
    # Sorted like ImageFolder would sort an ImageNet-100 folder, so labels match other codebases.
    classes = sorted(imagenet100_classes())
    splits = []
    for split in ("train", "val"):
        split_dir = root / split
        if not split_dir.is_dir():
            raise UserError(f"{root} has no {split}/ folder; expected {_EXPECTED_LAYOUT['in100']}")
        if split == "val" and _has_loose_images(split_dir):
            raise UserError(f"{split_dir} holds image files directly; validation images must be sorted into "
                            "val/<wnid>/ class folders (e.g. with the common valprep.sh script or LOC_val_solution.csv)")
        # Only the listed folders are scanned: a full ImageNet has 900 more we do not need.
        missing = [c for c in classes if not (split_dir / c).is_dir()]
        if missing:
            raise UserError(f"{split_dir} lacks {len(missing)} of the 100 ImageNet-100 class folders "
                            f"({_few(missing)}); point data_dir at a full ImageNet or ImageNet-100 folder")
        splits.append(_files_dataset(_scan_split(split_dir, classes), classes, skip_bad))
    return DataSpec(splits[0], splits[1], classes, channels=3)
