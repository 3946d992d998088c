"""The datasets, read from local files, and the generated compositional benchmark.

Digits, CIFAR-10/100, any ImageFolder tree and ImageNet-100.

Nothing here downloads: the machines this runs on are offline, so every dataset except the
scikit-learn digits (bundled in its wheel) is read from a folder the user points at, and every
layout problem is reported as a one-line ``UserError`` naming the expected layout.
"""
from __future__ import annotations

import importlib.resources
import os
import pickle
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Subset

from bayesncl_pyro.data.compositional import load_compositional, parse_cells
from bayesncl_pyro.data.images import IMAGE_EXTENSIONS, DataSpec, ImageFiles, TensorImages
from bayesncl_pyro.errors import UserError

DATASETS: tuple[str, ...] = ("digits", "cifar10", "cifar100", "imagefolder", "in100", "compositional")

# Held-out split folder names, in the order they are looked for.
_HELD_OUT_SPLITS = ("val", "test")


def load_dataset(
    name: str, data_dir: str | os.PathLike | None = None, *, seed: int = 0, skip_bad: bool = False,
    train_subset: int | None = None, holdout: str | None = None,
) -> DataSpec:
    """Load ``name`` (one of ``DATASETS``) from ``data_dir``.

    ``seed`` fixes the digits train/test split and the generated compositional images (the other
    datasets have official splits), and which images a ``train_subset`` keeps.
    ``skip_bad`` makes image-file datasets skip unreadable files instead of raising.
    ``train_subset``: keep only this many training images, drawn at random (the test split is kept whole).
    ``holdout``: compositional only, ``shape:background`` cells left out of training and testing, whose test images
    become the novel set ``unseen-combinations`` (``compositional.load_compositional``).
    """
    if holdout and name != "compositional":
        raise UserError(f"--holdout-cells holds out (shape, background) cells of the compositional benchmark; "
                        f"{name!r} has no such cells: drop --holdout-cells or use --dataset compositional")
    spec = load_compositional(seed, holdout=parse_cells(holdout)) if name == "compositional" else _load(
        name, data_dir, seed, skip_bad)
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
FOLDER_DATASETS: tuple[str, ...] = tuple(_EXPECTED_LAYOUT)  # the datasets read from a --data-dir


def _existing_dir(name: str, data_dir: str | os.PathLike | None) -> Path:
    if data_dir is None:
        raise UserError(f"dataset {name!r} needs a data directory (--data-dir): {_EXPECTED_LAYOUT[name]}")
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise UserError(f"data directory {root} does not exist; for {name!r} pass {_EXPECTED_LAYOUT[name]}")
    return root


# --------------------------------------------------------------------------------------------- digits


def _load_digits(seed: int) -> DataSpec:
    from sklearn.datasets import load_digits  # late: only the digits need scikit-learn
    from sklearn.model_selection import train_test_split  # late: as above

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
            names = _entry(candidate / meta_file, names_key)
            if not (isinstance(names, list) and len(names) == num_classes
                    and all(isinstance(c, (bytes, str)) for c in names)):
                raise UserError(f"{candidate / meta_file}: its {names_key} is not a list of {num_classes} class names; "
                                "re-extract the official python-version archive")
            classes = [c.decode(errors="backslashreplace") if isinstance(c, bytes) else c for c in names]
            train = _cifar_pickles([candidate / f for f in train_files], label_key, num_classes)
            test = _cifar_pickles([candidate / f for f in test_files], label_key, num_classes)
            return DataSpec(train, test, classes, channels=3)
    if (root / "train").is_dir():
        spec = _load_image_folder(root, skip_bad=skip_bad)
        if spec.num_classes != num_classes:
            raise UserError(f"{root} holds {spec.num_classes} class folders but {name} has {num_classes}; "
                            f"point data_dir at a {name} folder")
        return spec
    raise UserError(f"{root} is not a {name} folder: expected {_EXPECTED_LAYOUT[name]}")


class _CifarUnpickler(pickle.Unpickler):
    """An unpickler that reads CIFAR's files and refuses any other object.

    CIFAR's files hold dicts, lists, bytes, text, numbers and numpy arrays; anything else is refused: a pickle names the
    functions it calls, and a data folder may be someone else's.
    """

    _ARRAYS = {(module, name) for module in ("numpy.core.multiarray", "numpy._core.multiarray")
               for name in ("_reconstruct", "scalar")} | {
        ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self._ARRAYS:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which no CIFAR file holds")
        return super().find_class(module, name)


def _unpickle(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"missing CIFAR file {path}; re-extract the official python-version archive")
    # The official files are Python 2 pickles: keys and class names come back as bytes.
    try:
        with open(path, "rb") as f:
            batch = _CifarUnpickler(f, encoding="bytes").load()
    except Exception as e:  # whatever a file that is no pickle, or another pickle, fails with
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{path} is not a CIFAR batch ({cause}); re-extract the official python-version "
                        "archive") from None
    if not isinstance(batch, dict):
        raise UserError(f"{path} is not a CIFAR batch (it holds a {type(batch).__name__}, not a dict); re-extract "
                        "the official python-version archive")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}


def _entry(path: Path, key: str):
    """The ``key`` entry of the CIFAR file at ``path``, or a UserError naming what it holds instead."""
    batch = _unpickle(path)
    if key not in batch:
        raise UserError(f"{path} holds no {key!r} (it holds {sorted(map(str, batch))[:6]}); re-extract the official "
                        "python-version archive")
    return batch[key]


def _cifar_pickles(paths: list[Path], label_key: str, num_classes: int) -> TensorImages:
    """Read and check the images and labels of CIFAR batch files.

    Checked now, before any training: rows of 3072 bytes (the 1024
    red pixels row-major, then green, then blue), one label in [0, num_classes) per row.
    """
    images, labels = [], []
    for path in paths:
        data, ys = np.asarray(_entry(path, "data")), _entry(path, label_key)
        if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.dtype != np.uint8:
            raise UserError(f"{path}: its data is {data.dtype} of shape {data.shape}, not rows of 3072 bytes (32 x 32 "
                            "RGB); re-extract the official python-version archive")
        ys = np.asarray(ys)
        if ys.shape != (len(data),) or ys.dtype.kind not in "iu" or (
                len(ys) and not 0 <= ys.min() <= ys.max() < num_classes):
            raise UserError(f"{path}: its {label_key} are not {len(data)} class numbers in [0, {num_classes}), one per "
                            "image; re-extract the official python-version archive")
        images.append(data)
        labels += ys.tolist()
    return TensorImages(torch.from_numpy(np.concatenate(images).reshape(-1, 3, 32, 32)), labels)


# ------------------------------------------------------------------------------------- image folders


def _load_image_folder(root: Path, skip_bad: bool) -> DataSpec:
    present = [s for s in _HELD_OUT_SPLITS if (root / s).is_dir()]
    if not (root / "train").is_dir() or len(present) != 1:
        found = sorted(p.name for p in root.iterdir() if p.is_dir())
        raise UserError(f"{root} should hold train/ and exactly one of val/ or test/ "
                        f"(found folders: {found or 'none'})")
    train = _scan_split(root / "train")
    test = _scan_split(root / present[0])
    if train.keys() != test.keys():
        only_train, only_test = sorted(train.keys() - test.keys()), sorted(test.keys() - train.keys())
        raise UserError(f"train/ and {present[0]}/ class folders differ: only in train {_few(only_train)}, "
                        f"only in {present[0]} {_few(only_test)}; both splits need the same classes")
    classes = sorted(train)
    return DataSpec(_files_dataset(train, classes, skip_bad), _files_dataset(test, classes, skip_bad),
                    [_text(c) for c in classes], channels=3)


def _text(name: str) -> str:
    r"""A folder's name as text that every writer takes.

    Bytes that are not UTF-8 (which Python keeps as lone surrogates, and a UTF-8 file, netCDF or JSON writer
    refuses) become backslash escapes, e.g. caf\xe9.
    """
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _class_dirs(split_dir: Path) -> list[Path]:
    """Class sub-folders of ``split_dir``, sorted; hidden folders (.ipynb_checkpoints...) skipped."""
    return sorted(p for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def _loose_images(split_dir: Path) -> int:
    """The number of image files directly in ``split_dir``, outside any class folder."""
    return sum(p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS for p in split_dir.iterdir())


def _scan_split(split_dir: Path, classes: list[str] | None = None) -> dict[str, list[Path]]:
    """Map class name -> sorted image paths under ``split_dir/<class>/`` (searched recursively).

    ``classes`` restricts the scan to those folders, which must all exist.
    """
    if classes is None:
        dirs = _class_dirs(split_dir)
        if not dirs:
            loose = _loose_images(split_dir)
            found = f"{loose} images and no class folders" if loose else "no class folders"
            raise UserError(f"{split_dir} holds {found}; sort the images into one folder per class, "
                            f"{split_dir}/<class>/<image> (e.g. {split_dir}/cat/0001.jpg)")
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
    text = importlib.resources.files("bayesncl_pyro.data").joinpath("imagenet100_classes.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip()]


def _load_in100(root: Path, skip_bad: bool) -> DataSpec:
    # Sorted like ImageFolder would sort an ImageNet-100 folder, so labels match other codebases.
    classes = sorted(imagenet100_classes())
    splits = []
    for split in ("train", "val"):
        split_dir = root / split
        if not split_dir.is_dir():
            raise UserError(f"{root} has no {split}/ folder; expected {_EXPECTED_LAYOUT['in100']}")
        if split == "val" and (loose := _loose_images(split_dir)):
            raise UserError(f"{split_dir} holds {loose} image files directly; validation images must be sorted "
                            "into val/<wnid>/ class folders (e.g. with the common valprep.sh script or "
                            "LOC_val_solution.csv)")
        # Only the listed folders are scanned: a full ImageNet has 900 more we do not need.
        missing = [c for c in classes if not (split_dir / c).is_dir()]
        if missing:
            raise UserError(f"{split_dir} lacks {len(missing)} of the 100 ImageNet-100 class folders "
                            f"({_few(missing)}); point data_dir at a full ImageNet or ImageNet-100 folder")
        splits.append(_files_dataset(_scan_split(split_dir, classes), classes, skip_bad))
    return DataSpec(splits[0], splits[1], classes, channels=3)
