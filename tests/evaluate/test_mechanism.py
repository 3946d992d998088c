"""What the gates select and what they do to the representation: the mask overlap with post-hoc TopK, DCI against the
known factors, and the gradient conflict split by the factor a dim tracks; each on a hand case, and together in a
run's eval.json."""

import math

import numpy as np
import pytest
import torch

from bayesncl_pyro.config import Config
from bayesncl_pyro.data import DataSpec, TensorImages, load_dataset
from bayesncl_pyro.evaluate import heldout
from bayesncl_pyro.evaluate.dci import completeness, dci, disentanglement, importance_matrix
from bayesncl_pyro.evaluate.diagnostics import conflict_by_factor, conflict_record, to_json
from bayesncl_pyro.evaluate.matched import RANDOM_MASKS, control_masks, count_matched_controls, mask_jaccard
from bayesncl_pyro.infer.learner import ContrastiveLearner
from bayesncl_pyro.nn.losses import normalize
from bayesncl_pyro.rundir import CONFLICT
from bayesncl_pyro.train.resolve import resolve


def test_mask_jaccard_hand_case_leaves_out_images_where_both_keep_nothing():
    kept = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    other = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0]], dtype=torch.bool)
    # image 0: {0, 1} and {0, 2} share 1 of 3; image 1 has nothing to compare; image 2: the same set
    assert mask_jaccard(kept, other) == pytest.approx((1 / 3 + 1) / 2)
    assert mask_jaccard(kept[1:2], other[1:2]) == 0.0


def test_gates_that_keep_each_images_largest_entries_overlap_posthoc_topk_fully_and_random_masks_less():
    g = torch.Generator().manual_seed(0)
    ungated = normalize(torch.rand(200, 16, generator=g))  # every entry active
    counts = torch.randint(1, 8, (200,), generator=g)
    largest = ungated.argsort(dim=1, descending=True).argsort(dim=1) < counts[:, None]
    features = normalize(ungated * largest)
    labels = torch.randint(4, (200,), generator=g)
    out = count_matched_controls(ungated, features, labels, seed=1)
    assert out["mask_jaccard"] == 1.0
    # the random masks are the controls' own, and their overlap is what they give with F's entries
    randoms = control_masks(ungated, features, seed=1)["random_per_image"]
    assert out["mask_jaccard_random"] == pytest.approx(sum(mask_jaccard(largest, m) for m in randoms) / RANDOM_MASKS)
    # c of 16 entries kept at random: the expected overlap with a fixed c is well below 1 for c < 8
    assert out["mask_jaccard_random"] < 0.5


def test_dci_of_a_hand_written_importance_matrix():
    r = np.array([[2.0, 0.0], [1.0, 1.0], [0.0, 1.0]])  # 3 codes x 2 factors, total 5
    # codes: 0 and 2 predict one factor each (D_k = 1), code 1 both equally (D_k = 0); weights 2/5, 2/5, 1/5
    assert disentanglement(r) == pytest.approx(2 / 5 * 1 + 2 / 5 * 0 + 1 / 5 * 1, abs=1e-9)

    def h3(*p):  # entropy in base 3 (3 codes)
        return -sum(x * math.log(x) for x in p if x > 0) / math.log(3)

    # factor 0 spread over codes (2/3, 1/3, 0), factor 1 over (0, 1/2, 1/2); weights 3/5 and 2/5
    assert completeness(r) == pytest.approx(3 / 5 * (1 - h3(2 / 3, 1 / 3)) + 2 / 5 * (1 - h3(1 / 2, 1 / 2)), abs=1e-9)
    assert disentanglement(np.zeros((3, 2))) == pytest.approx(0.0, abs=1e-9)  # nothing predicts: uniform, no credit


def test_dci_of_codes_that_copy_one_factor_each_is_near_one_and_of_mixed_codes_lower():
    g = torch.Generator().manual_seed(0)
    shape, background = torch.randint(8, (800,), generator=g), torch.randint(4, (800,), generator=g)
    noise = torch.rand(800, 2, generator=g) * 0.01
    factors = {"class": shape, "background": background}
    separate = dci(torch.stack([shape.double(), background.double()], dim=1) + noise, factors)
    assert separate["dci_disentanglement"] > 0.95 and separate["dci_completeness"] > 0.95
    assert separate["dci_informativeness_class"] == 1.0 and separate["dci_informativeness_background"] == 1.0
    # each code a mix of both factors: both codes serve both, so neither score is near one
    mixed = dci(torch.stack([4 * shape + background, 4 * background + shape], dim=1).double() + noise, factors)
    assert mixed["dci_disentanglement"] < 0.8 and mixed["dci_completeness"] < 0.8
    r, _ = importance_matrix(np.c_[shape.numpy(), background.numpy()], np.c_[shape.numpy(), background.numpy()])
    assert r.shape == (2, 2) and r[0, 0] > 0.99 and r[1, 1] > 0.99


def test_conflict_is_averaged_over_the_dims_tracking_each_factor_that_training_measured():
    table = {"cancellation": np.array([0.9, np.nan, 0.5, 0.2, 0.7])}
    tracking = {"background": torch.tensor([True, True, False, False, False]),
                "class": torch.tensor([False, False, True, True, False]),
                "texture": torch.tensor([False, True, False, False, False])}  # its one dim never measured
    out = conflict_by_factor(table, tracking)
    assert out == {"conflict_background": pytest.approx(0.9), "conflict_dims_background": 1,
                   "conflict_class": pytest.approx(0.35), "conflict_dims_class": 2, "conflict_dims_texture": 0}


def test_a_runs_evaluation_on_data_with_factors_carries_dci_conflict_and_mask_overlap(tmp_path):
    digits = load_dataset("digits", None, seed=0)
    labels = torch.tensor(digits.test.labels)
    test = TensorImages(digits.test.images, digits.test.labels, factors={"class": labels, "background": labels % 2})
    data = DataSpec(digits.train, test, digits.classes, digits.channels)
    cfg = resolve(Config(dataset="digits", proj_hidden=32, proj_dim=16, workers=0, out=str(tmp_path)))
    learner = ContrastiveLearner(cfg, data.channels, len(data.train)).eval()
    g = torch.Generator().manual_seed(0)
    (tmp_path / CONFLICT).write_text("".join(
        to_json(dict(step=s, **conflict_record(normalize(torch.rand(20, 16, generator=g)), 0.2))) + "\n"
        for s in (5, 10, 15)))
    results = heldout.evaluate(learner, data, cfg, "cpu")
    assert 0 <= results["dci_disentanglement"] <= 1 and 0 <= results["dci_completeness"] <= 1
    assert {"dci_informativeness_class", "dci_informativeness_background"} <= results.keys()
    assert results["conflict_dims_class"] + results["conflict_dims_background"] <= 16
    assert ("conflict_class" in results) == (results["conflict_dims_class"] > 0)
    assert all(0 <= results["controls"][k] <= 1 for k in ("mask_jaccard", "mask_jaccard_random"))
    assert {"mask_jaccard", "mask_jaccard_random"} <= results["control_definitions"].keys()
