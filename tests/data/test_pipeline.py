"""The input pipeline of the device path: the prefetcher's thread, the training set held on the device, and
training from it (seeded by step, exact resume)."""

import threading

import numpy as np
import pytest
import torch
from helpers import assert_resume_is_exact
from PIL import Image
from torchvision.transforms.v2.functional import pil_to_tensor

from bayesncl_pyro.config import Config
from bayesncl_pyro.data import load_dataset
from bayesncl_pyro.data import resident as resident_module
from bayesncl_pyro.data.pipeline import EpochSampler, IndexBatches, ResidentViews, prefetch
from bayesncl_pyro.data.resident import resident_images
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.train.trainer import Trainer

CPU = torch.device("cpu")


def _threads():
    return {t for t in threading.enumerate() if t.name == "input-pipeline"}


def _views(batch, k):
    return torch.full((2,), float(batch * 10 + k))


def test_prefetched_batches_equal_the_inline_ones_and_the_thread_ends():
    inline = list(prefetch(range(7), _views, CPU, ahead=0))
    assert [x.tolist() for x in list(prefetch(range(7), _views, CPU, ahead=2))] == [x.tolist() for x in inline]
    assert [x[0].item() for x in inline] == [11 * k for k in range(7)]
    assert not _threads()


def test_stopping_early_ends_the_thread():
    before = _threads()
    for k, _ in enumerate(prefetch(iter(range(10**6)), _views, CPU, ahead=2)):
        if k == 3:
            break
    assert _threads() == before  # joined when the loop let go of the generator

    with pytest.raises(KeyboardInterrupt):
        for _ in prefetch(iter(range(10**6)), _views, CPU, ahead=2):
            raise KeyboardInterrupt  # what a second Ctrl-C does mid-step
    assert _threads() == before


def test_an_error_in_the_thread_is_raised_to_the_consumer():
    def make(batch, k):
        if k == 2:
            raise UserError("cannot read image x.jpg (broken data stream)")
        return torch.zeros(1)

    got = []
    with pytest.raises(UserError, match=r"^cannot read image x\.jpg \(broken data stream\)$"):
        for x in prefetch(range(5), make, CPU, ahead=2):
            got.append(x)
    assert len(got) == 2 and not _threads()


def test_index_batches_follow_the_sampler_mod_n_and_drop_the_last_partial_batch():
    sampler = EpochSampler(10, 4, seed=3)
    sampler.set_epoch(2)
    rows = list(IndexBatches(sampler, 4, 10))
    assert len(rows) == 2 == len(IndexBatches(sampler, 4, 10))
    assert torch.cat(rows).tolist() == [i % 10 for i in list(sampler)]


def _jpeg_tree(root, sizes):
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate(sizes):
        for split in ("train", "test"):
            path = root / split / "ab"[i % 2] / f"{i}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path, quality=90)
    return root


def test_image_folders_of_one_small_size_are_decoded_once_with_pil(tmp_path):
    spec = load_dataset("imagefolder", _jpeg_tree(tmp_path / "same", [(32, 32)] * 6), train_subset=5)
    images = resident_images(spec.train, CPU, workers=0)
    assert images.shape == (5, 3, 32, 32) and images.dtype == torch.uint8
    for i in range(5):  # row i is item i of the split, as the worker path reads it
        assert torch.equal(images[i], pil_to_tensor(spec.train[i][0]))
    mixed = load_dataset("imagefolder", _jpeg_tree(tmp_path / "mixed", [(32, 32)] * 5 + [(32, 30)]))
    assert resident_images(mixed.train, CPU) is None


def test_in_memory_sets_are_held_when_they_fit(monkeypatch):
    digits = load_dataset("digits", train_subset=100).train
    images = resident_images(digits, CPU)
    assert torch.equal(images, digits.dataset.images[digits.indices])
    monkeypatch.setattr(resident_module, "RESIDENT_MEMORY_SHARE", 100 * 64 / resident_module.free_memory(CPU) / 2)
    assert resident_images(digits, CPU) is None  # 6400 bytes, more than the share


def test_resident_views_are_drawn_in_batches_and_seeded_by_step():
    images = torch.randint(0, 256, (20, 3, 32, 32), dtype=torch.uint8)
    views = ResidentViews(images, 32, seed=0)
    rows = torch.tensor([3, 7, 7, 1])
    x = views(rows, step=5)
    assert x.shape == (8, 3, 32, 32)
    torch.testing.assert_close(views(rows, step=5), x, rtol=0, atol=0)
    assert not torch.allclose(views(rows, step=6), x)


def _run(tmp_path, name, **kw):
    return Config(dataset="digits", proj_hidden=16, proj_dim=8, batch_size=128, epochs=2, warmup_epochs=0,
                  workers=0, log_every=1, train_subset=384, out=str(tmp_path / name), **{"augment": "device", **kw})


def test_training_from_the_resident_set_resumes_exactly(tmp_path):
    straight = Trainer(_run(tmp_path, "a"), progress=False)
    assert isinstance(straight.input.views, ResidentViews) and straight.total_steps == 6
    assert_resume_is_exact(straight, lambda **kw: _run(tmp_path, "b", **kw))
