"""Data loading and augmentation, on tiny generated folders (plus the real CIFAR-10 archive when present)."""

import pickle
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_tree, write_cifar_pickles, write_image
from PIL import Image

from bayesncl_pyro.data import DATASETS, imagenet100_classes, load_dataset
from bayesncl_pyro.data.views import TwoViews, eval_transform, simclr_transform
from bayesncl_pyro.errors import UserError

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


# --------------------------------------------------------------------------------------------- digits


def test_digits_sizes_shapes_and_stratified_split():
    spec = load_dataset("digits")
    assert (len(spec.train), len(spec.test)) == (1437, 360)
    assert spec.num_classes == 10 and spec.channels == 1
    image, label = spec.train[0]
    assert image.shape == (1, 8, 8) and image.dtype == torch.uint8 and isinstance(label, int)
    assert int(spec.train.images.max()) == 255
    # Stratified: every class keeps about 20% of its images in the test split.
    train_counts, test_counts = Counter(spec.train.labels), Counter(spec.test.labels)
    for c in range(10):
        assert abs(test_counts[c] / (train_counts[c] + test_counts[c]) - 0.2) < 0.02


def test_digits_split_is_determined_by_seed():
    a, b, c = load_dataset("digits", seed=1), load_dataset("digits", seed=1), load_dataset("digits", seed=2)
    assert torch.equal(a.test.images, b.test.images) and a.test.labels == b.test.labels
    assert not torch.equal(a.test.images, c.test.images)


def test_train_subset_is_random_seeded_and_checked():
    full = load_dataset("digits")
    a, b = load_dataset("digits", train_subset=100), load_dataset("digits", train_subset=100)
    assert len(a.train) == 100 and len(a.test) == len(full.test)
    assert a.train.indices == b.train.indices and sorted(a.train.indices) != list(range(100))
    assert torch.equal(a.train[0][0], full.train[a.train.indices[0]][0])
    assert load_dataset("digits", seed=1, train_subset=100).train.indices != a.train.indices
    with pytest.raises(UserError, match="--train-subset must lie in"):
        load_dataset("digits", train_subset=len(full.train) + 1)


# --------------------------------------------------------------------------------------- compositional


def test_compositional_factors_are_as_declared():
    from bayesncl_pyro.data.compositional import BACKGROUNDS, COMPOSITIONAL_SIZES, SHAPES

    spec = load_dataset("compositional")
    assert spec.classes == list(SHAPES) and spec.channels == 3
    for split, per_cell in ((spec.train, COMPOSITIONAL_SIZES["train"]), (spec.test, COMPOSITIONAL_SIZES["test"])):
        n = per_cell * len(SHAPES) * len(BACKGROUNDS)
        assert split.images.shape == (n, 3, 32, 32) and split.images.dtype == torch.uint8
        assert set(split.factors) == {"class", "background"}
        assert split.factors["class"].tolist() == split.labels
        cells = Counter(zip(split.factors["class"].tolist(), split.factors["background"].tolist()))
        assert len(cells) == len(SHAPES) * len(BACKGROUNDS) and set(cells.values()) == {per_cell}


def test_compositional_background_is_visible_and_generation_is_seeded():
    a, b, c = (load_dataset("compositional", seed=s) for s in (0, 0, 1))
    assert torch.equal(a.train.images, b.train.images) and torch.equal(a.test.factors["background"],
                                                                         b.test.factors["background"])
    assert not torch.equal(a.train.images, c.train.images)
    # the corners are background: their mean colour separates the backgrounds
    corner = a.test.images[:, :, :3, :3].float().mean(dim=(2, 3))  # N x 3
    bg = a.test.factors["background"]
    means = torch.stack([corner[bg == v].mean(0) for v in range(4)])
    assert torch.cdist(means, means).add(torch.eye(4) * 1e3).min() > 15


# --------------------------------------------------------------------------------------- image folders


def test_imagefolder_converts_every_mode_to_rgb(tmp_path):
    make_tree(tmp_path, {"train": ["cat", "dog"], "val": ["cat", "dog"]})
    write_image(tmp_path / "train" / "cat" / "gray.png", "L")
    write_image(tmp_path / "train" / "cat" / "alpha.png", "RGBA")
    write_image(tmp_path / "train" / "dog" / "cmyk.JPEG", "CMYK", fmt="JPEG")
    (tmp_path / "train" / "dog" / "notes.txt").write_text("not an image")
    spec = load_dataset("imagefolder", tmp_path)
    assert spec.classes == ["cat", "dog"] and spec.channels == 3
    assert (len(spec.train), len(spec.test)) == (5, 2)
    assert sorted(label for _, label in spec.train) == [0, 0, 0, 1, 1]
    for image, _ in spec.train:
        assert image.mode == "RGB" and image.size == (12, 10)


@pytest.mark.parametrize(
    "splits, match",
    [
        ({"train": ["a"]}, "exactly one of val/ or test/"),
        ({"val": ["a"]}, "should hold train/"),
        ({"train": ["a", "b"], "val": ["a", "c"]}, "only in train b, only in val c"),
    ],
)
def test_imagefolder_layout_errors(tmp_path, splits, match):
    make_tree(tmp_path, splits)
    with pytest.raises(UserError, match=match):
        load_dataset("imagefolder", tmp_path)


def test_empty_class_folder_is_named(tmp_path):
    make_tree(tmp_path, {"train": ["a"], "test": ["a"]})
    (tmp_path / "train" / "empty").mkdir()
    with pytest.raises(UserError, match=r"class folder .*empty holds no images"):
        load_dataset("imagefolder", tmp_path)


@pytest.mark.parametrize("name", ["cifar10", "cifar100", "imagefolder", "in100"])
def test_missing_data_dir_names_expected_layout(tmp_path, name):
    with pytest.raises(UserError, match="needs a data directory"):
        load_dataset(name)
    with pytest.raises(UserError, match="does not exist"):
        load_dataset(name, tmp_path / "nowhere")


def test_unknown_dataset_lists_valid_names():
    with pytest.raises(UserError, match=", ".join(DATASETS)):
        load_dataset("mnist")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_bad_image_raises_or_is_skipped(tmp_path, damage):
    make_tree(tmp_path, {"train": ["a"], "test": ["a"]}, ext=".jpg")
    good = write_image(tmp_path / "train" / "a" / "1.jpg", size=(64, 64))
    bad = tmp_path / "train" / "a" / "bad.jpg"
    bad.write_bytes(b"not a jpeg" if damage == "garbage" else good.read_bytes()[:300])
    spec = load_dataset("imagefolder", tmp_path)
    i = [path for path, _ in spec.train.samples].index(bad)
    with pytest.raises(UserError, match=str(bad)):
        spec.train[i]
    skipping = load_dataset("imagefolder", tmp_path, skip_bad=True).train
    image, label = skipping[i]
    assert image.mode == "RGB" and label == 0 and skipping.bad_files == [str(bad)]


# ---------------------------------------------------------------------------------------------- CIFAR


@pytest.mark.parametrize("name, train_rows, classes", [("cifar10", 20, 10), ("cifar100", 4, 100)])
@pytest.mark.parametrize("point_at_folder", [True, False])
def test_cifar_pickles(tmp_path, name, train_rows, classes, point_at_folder):
    folder = write_cifar_pickles(tmp_path, name)
    spec = load_dataset(name, folder if point_at_folder else tmp_path)
    assert (len(spec.train), len(spec.test), spec.num_classes) == (train_rows, 4, classes)
    image, label = spec.test[1]
    assert image.shape == (3, 32, 32) and image.dtype == torch.uint8 and 0 <= label < classes
    # Channel-planar rows: the first 1024 bytes are the red plane.
    raw = pickle.loads((folder / ("test_batch" if name == "cifar10" else "test")).read_bytes())[b"data"][1]
    assert torch.equal(image[0].flatten(), torch.from_numpy(raw[:1024]))


def test_cifar_image_folder_variant_and_errors(tmp_path):
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    make_tree(tmp_path, {"train": names, "test": names}, ext=".jpg")
    spec = load_dataset("cifar10", tmp_path)
    assert spec.classes == names
    with pytest.raises(UserError, match="cifar100 has 100"):
        load_dataset("cifar100", tmp_path)
    with pytest.raises(UserError, match="cifar-10-batches-py"):
        load_dataset("cifar10", tmp_path / "train" / "cat")


def test_real_cifar10_archive(tmp_path):
    archive = SHARED_DATA / "cifar10-jpeg.tar.gz"
    if not archive.is_file():
        pytest.skip(f"real data archive {archive} is absent")
    per_class = Counter()
    with tarfile.open(archive, "r|gz") as tar:  # streaming: stop as soon as enough members are out
        for member in tar:
            parts = Path(member.name).parts  # cifar10/<split>/<class>/<file>
            if member.isfile() and len(parts) == 4 and per_class[parts[1:3]] < 2:
                target = tmp_path.joinpath(*parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
                per_class[parts[1:3]] += 1
                if len(per_class) == 20 and min(per_class.values()) == 2:
                    break
    spec = load_dataset("cifar10", tmp_path / "cifar10")
    assert spec.classes[0] == "airplane" and spec.classes[-1] == "truck"
    assert (len(spec.train), len(spec.test)) == (20, 20)
    image, _ = spec.train[0]
    assert image.size == (32, 32) and image.mode == "RGB"
    views = TwoViews(spec.train, simclr_transform(32))[5]
    assert views[0].shape == (3, 32, 32) and views[2] == 2


# ------------------------------------------------------------------------------------------- ImageNet


@pytest.fixture(scope="module")
def in100_wnids():
    wnids = imagenet100_classes()
    assert len(set(wnids)) == 100
    return wnids


def test_in100_selects_the_listed_classes_from_full_imagenet(tmp_path, in100_wnids):
    extra = ["n00000001", "n99999999"]
    make_tree(tmp_path, {s: in100_wnids + extra for s in ("train", "val")}, ext=".JPEG")
    spec = load_dataset("in100", tmp_path)
    assert spec.classes == sorted(in100_wnids)
    assert (len(spec.train), len(spec.test)) == (100, 100)


def test_in100_accepts_an_in100_folder_and_names_missing_classes(tmp_path, in100_wnids):
    make_tree(tmp_path, {s: in100_wnids for s in ("train", "val")})
    assert load_dataset("in100", tmp_path).num_classes == 100
    for wnid in in100_wnids[:3]:
        for f in (tmp_path / "val" / wnid).iterdir():
            f.unlink()
        (tmp_path / "val" / wnid).rmdir()
    with pytest.raises(UserError, match=r"lacks 3 of the 100 .*" + sorted(in100_wnids[:3])[0]):
        load_dataset("in100", tmp_path)


def test_loose_images_are_counted_and_the_layout_named(tmp_path):
    for i in range(50):
        write_image(tmp_path / "train" / f"{i}.png")
    write_image(tmp_path / "val" / "cat" / "0.png")
    with pytest.raises(UserError, match=r"train holds 50 images and no class folders; sort the images into one folder "
                       r"per class, .*train/<class>/<image> \(e\.g\. .*train/cat/0001\.jpg\)"):
        load_dataset("imagefolder", tmp_path)


def test_in100_flat_val_asks_for_class_folders(tmp_path, in100_wnids):
    make_tree(tmp_path, {"train": in100_wnids})
    write_image(tmp_path / "val" / "ILSVRC2012_val_00000001.JPEG", fmt="JPEG")
    with pytest.raises(UserError, match="holds 1 image files directly; .*val/<wnid>/ class folders"):
        load_dataset("in100", tmp_path)


# --------------------------------------------------------------------------------------------- views


@pytest.mark.parametrize("size, channels", [(8, 1), (32, 3), (64, 3)])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_transforms_output_float_tensors(size, channels, as_tensor):
    pil = Image.new("L" if channels == 1 else "RGB", (size + 5, size + 3), 90)
    image = torch.from_numpy(np.array(pil)).reshape(size + 3, size + 5, -1).permute(2, 0, 1) if as_tensor else pil
    for transform in (simclr_transform(size, channels), eval_transform(size, channels)):
        out = transform(image)
        assert type(out) is torch.Tensor and out.dtype == torch.float32 and out.shape == (channels, size, size)


def test_bad_normalisation_is_a_user_error():
    with pytest.raises(UserError, match="need 1 values"):
        simclr_transform(8, 1, mean=(0.1, 0.2, 0.3), std=(1, 1, 1))


def test_two_views_differ_and_are_seeded_by_epoch_and_item():
    spec = load_dataset("digits")
    pairs = TwoViews(spec.train, simclr_transform(8, 1), seed=3)
    n = len(spec.train)
    torch.manual_seed(0)
    v1, v2, label, index = pairs[7]
    assert v1.shape == v2.shape == (1, 8, 8) and label == spec.train[7][1] and index == 7
    assert not torch.equal(v1, v2)
    torch.manual_seed(1)  # the global RNG neither matters nor moves
    state = torch.get_rng_state()
    w1, w2, _, _ = pairs[7]
    assert torch.equal(v1, w1) and torch.equal(v2, w2)
    assert torch.equal(state, torch.get_rng_state())
    e1, _, _, index = pairs[n + 7]  # the same item in the next epoch: new views
    assert index == 7 and not torch.equal(e1, v1)
    assert not torch.equal(TwoViews(spec.train, simclr_transform(8, 1), seed=4)[7][0], v1)


@pytest.mark.parametrize("sigma", [0.1, 0.4, 0.7, 1.3, 2.0])
def test_gaussian_blur_equals_torchvisions(sigma):
    from torchvision.transforms.v2.functional import gaussian_blur as tv_blur

    from bayesncl_pyro.data.recipe import blur_taps
    from bayesncl_pyro.data.views import gaussian_blur

    x = torch.rand(2, 3, 40, 52, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(gaussian_blur(x, sigma, 23), tv_blur(x, [23, 23], [sigma, sigma]), rtol=0, atol=1e-5)
    taps = blur_taps(sigma, 23)  # no subnormal taps (10x slower arithmetic)
    assert bool(((taps == 0) | (taps >= torch.finfo(taps.dtype).tiny)).all())


def _photo(h=90, w=120) -> Image.Image:
    """A smooth colourful image with every pixel coloured (gray views are then exactly the grayscale ones)."""
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    rgb = np.stack([0.2 + 0.7 * x, 0.9 - 0.6 * y, 0.3 + 0.5 * (x * y)], -1)
    return Image.fromarray(np.round(rgb * 255).astype(np.uint8))


def test_colour_view_with_the_random_ops_off_is_torchvisions_crop(monkeypatch):
    from torchvision.transforms import v2

    from bayesncl_pyro.data import recipe, views

    for p in ("P_JITTER", "P_GRAY", "P_BLUR", "P_FLIP"):
        monkeypatch.setattr(views, p, 0.0)
    image = _photo()
    torch.manual_seed(5)
    view = simclr_transform(48)(image)
    torch.manual_seed(5)
    crop = v2.RandomResizedCrop(48, scale=recipe.CROP_SCALE, ratio=recipe.CROP_RATIO,
                                interpolation=v2.InterpolationMode.BICUBIC,
                                antialias=True)(v2.functional.pil_to_tensor(image))
    expected = v2.functional.normalize(crop.float() / 255, recipe.IMAGENET_MEAN, recipe.IMAGENET_STD)
    torch.testing.assert_close(view, expected, rtol=0, atol=1e-5)


def test_colour_views_apply_each_op_at_the_recipes_rate():
    from bayesncl_pyro.data.recipe import IMAGENET_MEAN, IMAGENET_STD

    image, transform = _photo(), simclr_transform(40)
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    torch.manual_seed(0)
    views = torch.stack([transform(image) for _ in range(400)]) * std + mean
    assert views.shape == (400, 3, 40, 40) and views.dtype == torch.float32
    assert float(views.min()) >= -1e-5 and float(views.max()) <= 1 + 1e-5
    gray = (views.amax(1) - views.amin(1)).amax((1, 2)) < 1e-5
    assert 50 <= int(gray.sum()) <= 110  # p = 0.2: 80 +- 8
    # the photo gets lighter to the right: a flipped view gets darker, whatever the crop and colours
    flipped = views[:, :, :, :20].mean((1, 2, 3)) > views[:, :, :, 20:].mean((1, 2, 3))
    assert 160 <= int(flipped.sum()) <= 240  # p = 0.5: 200 +- 10


def test_colour_views_are_seeded_and_the_same_from_pil_or_tensor():
    from torchvision.transforms.v2.functional import pil_to_tensor

    image = _photo()
    pairs = TwoViews([(image, 0), (pil_to_tensor(image), 0)], simclr_transform(40), seed=1)
    v1, v2, _, _ = pairs[0]
    assert not torch.equal(v1, v2)
    w1, w2, _, _ = pairs[2]  # item 0 again in epoch 1 (of 2 items): other views
    assert not torch.equal(v1, w1)
    u1, u2, _, _ = TwoViews([(image, 0)], simclr_transform(40), seed=1)[0]
    assert torch.equal(u1, v1) and torch.equal(u2, v2)
    # index 1 holds the same image as a tensor: item index seeds the views, so compare it with itself
    t1, t2, _, _ = pairs[1]
    p1, p2, _, _ = TwoViews([(image, 0), (image, 0)], simclr_transform(40), seed=1)[1]
    assert torch.equal(t1, p1) and torch.equal(t2, p2)


def test_colour_views_name_a_non_rgb_image():
    with pytest.raises(UserError, match="needs an RGB image"):
        simclr_transform(40)(torch.zeros(1, 50, 50, dtype=torch.uint8))


def test_the_input_package_has_no_import_circle_and_no_import_hidden_in_a_function():
    """Each file of bayesncl_pyro/data imports its siblings at its top, and they form no circle (a circle
    was once broken by an import inside a function; a hidden import hides the next one)."""
    import ast
    import graphlib

    import bayesncl_pyro.data as package

    folder = Path(package.__file__).parent
    files = {path.stem: path for path in folder.glob("*.py")}
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        top = set(tree.body)
        graph[name] = set()
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bayesncl_pyro.data")):
                continue
            # from bayesncl_pyro.data.decode import X, or from bayesncl_pyro.data import device_views
            siblings = ({node.module.rsplit(".", 1)[1]} if node.module != "bayesncl_pyro.data"
                        else {alias.name for alias in node.names} & set(files))
            assert node in top or not siblings, f"data/{path.name}:{node.lineno} imports {siblings} inside a function"
            graph[name] |= siblings
    order = list(graphlib.TopologicalSorter(graph).static_order())  # CycleError names the circle
    assert set(order) >= {"datasets", "decode", "views", "device_views", "pipeline"}
