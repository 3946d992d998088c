"""load_run: a trained run folder as an object that takes images in any common form."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from bayesncl_pyro import load_run
from bayesncl_pyro.data import load_dataset
from bayesncl_pyro.errors import UserError
from bayesncl_pyro.evaluate.arviz_export import read_gates
from bayesncl_pyro.evaluate.run import image_paths
from bayesncl_pyro.rundir import read_eval


@pytest.fixture
def run_dir(bayes_run):
    return bayes_run  # BayesNCL on digits, with gates.nc


@pytest.fixture(scope="module")
def test_images():
    return load_dataset("digits", seed=0).test.images  # uint8, N x 1 x 8 x 8: the run's test split


def test_on_the_test_split_it_gives_the_probabilities_of_gates_nc(run_dir, test_images):
    run = load_run(run_dir)
    saved = read_gates(run_dir)["gates"]
    probs = run.gate_probs(test_images)
    np.testing.assert_allclose(probs.numpy(), saved["inclusion_prob"].values, rtol=0, atol=1e-6)
    np.testing.assert_allclose(run.representation(test_images).numpy(), saved["features"].values, rtol=0, atol=1e-6)
    post = run.posterior(num_draws=2)
    torch.testing.assert_close(post.probs, probs)
    assert post.draws.shape == (2, *probs.shape)
    assert run.backbone_features(test_images[:3]).shape == (3, 256)


def test_images_as_files_pil_and_float_tensors_give_the_same(run_dir, test_images, tmp_path):
    run = load_run(run_dir)
    first = test_images[:12]
    expected = run.gate_probs(first)
    for i, image in enumerate(first):
        Image.fromarray(image[0].numpy(), mode="L").save(tmp_path / f"{i:02d}.png")
    (tmp_path / "notes.txt").write_text("not an image")
    assert [p.name for p in image_paths(tmp_path)] == [f"{i:02d}.png" for i in range(12)]
    torch.testing.assert_close(run.gate_probs(tmp_path), expected)
    torch.testing.assert_close(run.gate_probs(str(tmp_path / "03.png")), expected[3:4])
    pil = [Image.open(tmp_path / f"{i:02d}.png").convert("RGB") for i in range(12)]  # converted to the run's mode
    torch.testing.assert_close(run.gate_probs(pil), expected)
    torch.testing.assert_close(run.gate_probs(first.float() / 255), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(run.gate_probs(first[0]), expected[:1])
    torch.testing.assert_close(run.gate_probs([first[0], pil[1]]), expected[:2])


@pytest.mark.parametrize("images, message", [
    (torch.rand(2, 3, 8, 8), "1-channel images"),
    (torch.full((2, 1, 8, 8), 255.0), r"float images must lie in \[0, 1\]"),
    (torch.full((2, 1, 8, 8), float("nan")), r"float images must lie in \[0, 1\], without NaN"),
    (torch.zeros(2, 1, 8, 8, dtype=torch.int32), "integer images must be uint8"),
    ("missing.png", "cannot read image missing.png"),
    ([], "empty list"),
])
def test_bad_images_are_one_line(run_dir, images, message):
    with pytest.raises(UserError, match=message):
        load_run(run_dir).gate_probs(images)


def test_a_folder_without_images_and_a_folder_without_a_run(tmp_path, run_dir):
    with pytest.raises(UserError, match="holds no image files"):
        load_run(run_dir).gate_probs(tmp_path)
    with pytest.raises(UserError, match="holds no checkpoint.pt"):
        load_run(tmp_path)


def test_the_checkpoint_file_loads_as_its_folder_and_bad_arguments_are_one_line(run_dir, test_images, monkeypatch):
    run = load_run(run_dir / "checkpoint.pt")
    assert run.dir == run_dir
    torch.testing.assert_close(run.gate_probs(test_images[:4]), load_run(run_dir).gate_probs(test_images[:4]))
    with pytest.raises(UserError, match="batch_size must be a positive number of images, got 0"):
        run.gate_probs(test_images[:4], batch_size=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="device='cuda' was asked for but PyTorch sees no CUDA GPU; use cpu or auto"):
        load_run(run_dir, device="cuda")


def test_eval_json_counts_the_gates_open_at_the_evaluation_mask(run_dir, test_images, tmp_path, caplog):
    """``gates_open`` (``gate_rate`` before: the log's name for the mean inclusion probability) is the share of
    (image, feature) gates that the representation keeps; an earlier version's eval.json reads under the new name."""
    results = read_eval(run_dir)
    probs = read_gates(run_dir)["gates"]["inclusion_prob"].values
    assert "gate_rate" not in results and results["gates_open"] == pytest.approx((probs > 0.5).mean(), abs=1e-6)
    assert results["gates_open"] != pytest.approx(probs.mean(), abs=1e-3)
    (tmp_path / "eval.json").write_text(json.dumps({"gate_rate": 0.25, "semantic_consistency": 0.5}))
    # before the reference protocol, every evaluation was the fast one
    assert read_eval(tmp_path) == {"gates_open": 0.25, "semantic_consistency": 0.5, "protocol": "fast"}
    # 0.2.0 evaluated gs-reference-kl at q's mode: its numbers are kept, and the user hears how to redo them
    caplog.clear()
    assert read_eval(tmp_path, "gs-reference-kl")["gates_open"] == 0.25
    assert "evaluated the gs-reference-kl gates at q's mode" in caplog.text
