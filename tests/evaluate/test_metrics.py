import math

import pytest
import torch

from bayesncl_pyro.evaluate.metrics import (
    activation_rate,
    active_dims,
    effective_rank,
    interpretability_metrics,
    orthogonality,
    retrieval_precision,
    semantic_consistency,
    semantic_entropy,
    sparsity,
)


def entropy(*p):
    return -sum(x * math.log(x) for x in p if x > 0)


# Dim 0 fires for 3 of 4 samples, dim 1 is dead, dim 2 fires once above and once below threshold.
WITH_DEAD_DIM = torch.tensor([
    [1.0, 0.0, 0.0],
    [0.0, 0.0, 2.0],
    [3.0, 0.0, 0.0],
    [4.0, 0.0, 5e-6],
])


def test_semantic_consistency_hand_case():
    features = torch.tensor([[1.0, 0, 0], [1, 0, 0], [0, 0, 1], [1, 0, 1]])
    labels = torch.tensor([0, 0, 1, 1])
    # dim 0: samples 0, 1, 3 -> classes 0, 0, 1 -> 2/3; dim 1 dead; dim 2: samples 2, 3 -> class 1 -> 1
    assert semantic_consistency(features, labels) == pytest.approx((2 / 3 + 1) / 2)


def test_semantic_consistency_thresholds_after_row_normalisation():
    # 5e-6 is below 1e-5 raw, but 5e-3 of the row's norm: active once the row is normalised.
    features = torch.tensor([[1e-3, 5e-6], [0.0, 1.0]])
    labels = torch.tensor([0, 1])
    # dim 0: sample 0 -> 1; dim 1: samples 0 and 1 -> 1/2
    assert semantic_consistency(features, labels) == pytest.approx(0.75)


def test_dense_balanced_features_give_one_over_num_classes():
    features = torch.rand(600, 8) + 0.1
    labels = torch.arange(600) % 3
    assert semantic_consistency(features, labels) == pytest.approx(1 / 3, abs=1e-12)


def test_one_dim_per_class_is_perfectly_consistent_with_zero_entropy():
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 2])
    features = torch.nn.functional.one_hot(labels, 3).float() * torch.rand(7, 1)
    assert semantic_consistency(features, labels) == pytest.approx(1.0)
    assert semantic_entropy(features, labels) == pytest.approx(0.0)
    assert semantic_entropy(features, labels, weighting="frequency") == pytest.approx(0.0)


def test_semantic_entropy_hand_case_both_weightings():
    features = torch.tensor([[3.0, 2.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    labels = torch.tensor([0, 0, 1, 1])
    # dim 0: all mass in class 0 -> 0. dim 1: magnitude 2 vs 2 -> log 2; frequency 1 vs 2.
    assert semantic_entropy(features, labels) == pytest.approx(math.log(2) / 2)
    assert semantic_entropy(features, labels, weighting="frequency") == pytest.approx(
        entropy(1 / 3, 2 / 3) / 2)


def test_semantic_entropy_rejects_unknown_weighting():
    with pytest.raises(ValueError, match="weighting"):
        semantic_entropy(WITH_DEAD_DIM, torch.tensor([0, 1, 0, 1]), weighting="count")


def test_sparsity_active_dims_and_activation_rate_with_a_dead_dim():
    assert sparsity(WITH_DEAD_DIM) == pytest.approx(8 / 12)
    assert active_dims(WITH_DEAD_DIM) == 2
    # dim 0 active in 3/4 samples, dim 2 in 1/4; the dead dim is left out, unlike 1 - sparsity = 1/3
    assert activation_rate(WITH_DEAD_DIM) == pytest.approx(0.5)


def test_effective_rank():
    rank_one = torch.outer(torch.tensor([1.0, 2, 3, 4]), torch.tensor([1.0, -1, 2]))
    assert effective_rank(rank_one) == pytest.approx(0.0, abs=1e-6)
    orthogonal = torch.linalg.qr(torch.randn(6, 6)).Q
    assert effective_rank(orthogonal) == pytest.approx(math.log(6))
    assert effective_rank(torch.diag(torch.tensor([3.0, 1.0]))) == pytest.approx(entropy(3 / 4, 1 / 4))


def test_orthogonality():
    assert orthogonality(torch.linalg.qr(torch.randn(5, 5)).Q[:, :3]) == pytest.approx(0.0, abs=1e-6)
    # Alive columns [1, 0] and [1, 1]: cosine 1/sqrt 2 off the diagonal of a 2 x 2 matrix; the
    # dead third column must not enter the mean.
    features = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    assert orthogonality(features) == pytest.approx(2 * (1 / math.sqrt(2)) / 4)


def test_retrieval_on_separated_clusters_is_perfect():
    labels = torch.arange(60) % 3
    features = torch.nn.functional.one_hot(labels, 3).float() * 5 + 0.1 * torch.rand(60, 3)
    assert retrieval_precision(features, labels) == {1: 1.0, 3: 1.0, 5: 1.0, 10: 1.0}


def test_retrieval_excludes_the_query_itself():
    # Four directions 10 degrees apart with alternating labels: each nearest *other* point has the
    # other label, so P@1 = 0 (it would be 1 if the query retrieved itself); the 3 others hold 1 match.
    angles = torch.deg2rad(torch.tensor([0.0, 10, 20, 30]))
    features = torch.stack([angles.cos(), angles.sin()], dim=1)
    labels = torch.tensor([0, 1, 0, 1])
    assert retrieval_precision(features, labels, ks=(1, 3)) == {1: 0.0, 3: pytest.approx(1 / 3)}


def test_retrieval_excludes_the_query_by_index_so_duplicates_still_count():
    features = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    labels = torch.tensor([0, 1, 1, 0])
    assert retrieval_precision(features, labels, ks=(1,)) == {1: 0.0}


def test_retrieval_keeps_the_dims_with_largest_column_sum():
    # Column sums 11.1, 12, 4. With all dims, dim 2 pulls samples 0 and 2 together (cos 0.82 vs
    # 0.45 and 0.45), so they retrieve the wrong class and P@1 = 1/2. Dropping dim 2 leaves
    # 0 <-> 1 and 2 <-> 3 as nearest pairs: P@1 = 1.
    features = torch.tensor([[1.0, 0, 2], [10, 1, 0], [0.1, 1, 2], [0, 10, 0]])
    labels = torch.tensor([0, 0, 1, 1])
    assert retrieval_precision(features, labels, ks=(1,)) == {1: 0.5}
    assert retrieval_precision(features, labels, ks=(1,), num_dims=2) == {1: 1.0}


def test_retrieval_on_the_strongest_dims_matches_the_reference_formula_written_out():
    # The reference's retrieval: rank dims by column sum, keep the top num_dims, renormalise rows, take each
    # query's 11 most cosine-similar rows and drop the first (the query itself), score P@1, 3, 5, 10.
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(90) % 4
    raw = torch.relu(torch.randn(90, 40, generator=generator) + 0.5 * torch.nn.functional.one_hot(labels * 9, 40))
    features = torch.nn.functional.normalize(raw, dim=1)  # as the representation is evaluated
    for num_dims in (8, 32):
        kept = features[:, features.sum(dim=0).argsort(descending=True)[:num_dims]]
        kept = torch.nn.functional.normalize(kept, dim=1)
        neighbours = (kept @ kept.T).topk(11, dim=1).indices[:, 1:]
        assert torch.equal(neighbours, (kept @ kept.T).fill_diagonal_(-2).topk(10, dim=1).indices)  # no ties
        hits = (labels[neighbours] == labels[:, None]).double()
        expected = {k: pytest.approx(float(hits[:, :k].mean())) for k in (1, 3, 5, 10)}
        assert retrieval_precision(features, labels, num_dims=num_dims) == expected


def test_retrieval_needs_more_samples_than_k():
    with pytest.raises(ValueError, match="samples"):
        retrieval_precision(torch.rand(5, 2), torch.zeros(5, dtype=torch.long), ks=(5,))


def test_all_zero_features_do_not_crash():
    features = torch.zeros(12, 4)
    labels = torch.arange(12) % 2
    assert interpretability_metrics(features, labels) == {
        "semantic_consistency": 0.0,
        "semantic_consistency_topn": 0.0,
        "topn_coverage_dims": 0,
        "topn_coverage_images": 0.0,
        "semantic_entropy": 0.0,
        "activation_rate": 0.0,
        "active_dims": 0,
        "sparsity": 1.0,
        "effective_rank": 0.0,
        "orthogonality": 0.0,
    }
    precision = retrieval_precision(features, labels)
    assert all(0.0 <= p <= 1.0 for p in precision.values())


def test_factor_information_on_hand_built_features():
    from bayesncl_pyro.evaluate.metrics import factor_information, factor_tracking

    # 8 samples, 50 times: class = i % 4, background = i // 4 (two backgrounds, crossed with four classes)
    cls, bg = torch.arange(8).repeat(50) % 4, torch.arange(8).repeat(50) // 4
    pattern = torch.zeros(8, 5)
    pattern[[1, 5], 0] = 1.0  # fires for class 1 only
    pattern[4:, 1] = 2.0  # fires for background 1 only
    pattern[:, 2] = 1.0  # always on: carries no information
    pattern[[0, 3, 5, 6], 3] = 1.0  # independent of both: on in half of each class pair and each background
    pattern[5, 4] = 1.0  # a conjunction: class 1 on background 1
    feats = pattern.repeat(50, 1)
    info_cls, info_bg = factor_information(feats, cls), factor_information(feats, bg)
    # the plug-in information less its bias under independence, (V - 1) / 2N, over the dim's entropy
    def h(p):
        return -p * math.log(p) - (1 - p) * math.log(1 - p)

    bias_cls, bias_bg = 3 / 800, 1 / 800
    assert info_cls[:3].tolist() == pytest.approx([1 - bias_cls / h(1 / 4), 0, 0])
    assert info_bg[:3].tolist() == pytest.approx([0, 1 - bias_bg / h(1 / 2), 0])
    # dim 4 is on for 1 of 8: H = h(1/8); given the class, only class 1 is uncertain (h(1/2), weight 1/4)
    assert info_cls[4].item() == pytest.approx(1 - (0.25 * h(0.5) + bias_cls) / h(1 / 8))
    assert info_bg[4].item() == pytest.approx(1 - (0.5 * h(0.25) + bias_bg) / h(1 / 8))
    assert info_cls[3].item() == 0 and info_bg[3].item() == 0
    tracks = factor_tracking(feats, {"class": cls, "background": bg})
    assert tracks["class"].tolist() == [True, False, False, False, True]
    assert tracks["background"].tolist() == [False, True, False, False, False]


def test_a_dim_that_fires_in_a_few_images_does_not_track_a_factor_by_chance():
    """1,280 images of 8 classes: a dim on in 4 random images, independent of the class, once scored at least 0.1
    (its entropy is as small as the plug-in information's bias); a dim on for one class scores about 1."""
    from bayesncl_pyro.evaluate.metrics import factor_information

    generator = torch.Generator().manual_seed(0)
    cls = torch.arange(1280) % 8
    feats = torch.zeros(1280, 201)
    for k in range(200):
        feats[torch.randperm(1280, generator=generator)[:4], k] = 1.0
    feats[cls == 3, 200] = 1.0
    info = factor_information(feats, cls)
    assert (info[:200] >= 0.1).float().mean() < 0.01 and info[200] > 0.99


def test_factor_report_counts_the_dims_the_gates_close_per_factor():
    from bayesncl_pyro.evaluate.heldout import factor_report

    cls = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])
    bg = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
    ungated = torch.stack([bg.double(), cls.double()], 1)  # dim 0 fires with the background, dim 1 with the class
    probs = torch.tensor([[0.1, 0.9]]).expand(8, 2)  # the gates close dim 0 everywhere, keep dim 1
    gated = ungated * (probs > 0.5)
    report = factor_report(gated, {"class": cls, "background": bg}, ungated, (probs > 0.5).double())
    assert report == {"dims_tracking_class": 1, "dims_tracking_background": 0,
                      "ungated_dims_tracking_class": 1, "gated_off_dims_class": 0, "gated_off_share_class": 0.0,
                      "ungated_dims_tracking_background": 1, "gated_off_dims_background": 1,
                      "gated_off_share_background": 1.0}
    assert factor_report(gated, {"class": cls, "background": bg}) == {"dims_tracking_class": 1,
                                                                       "dims_tracking_background": 0}


def _class_blind(density, n=4000, k=64, classes=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % classes
    features = torch.rand(n, k, generator=g) * (torch.rand(n, k, generator=g) < density)
    return features, labels


def test_topn_consistency_of_class_blind_features_is_chance_at_every_density():
    from bayesncl_pyro.evaluate.metrics import topn_chance, topn_consistency, topn_size

    _, labels = _class_blind(0.5)
    n = topn_size(len(labels))
    assert n == 40  # 1 % of 4000
    chance = topn_chance(labels)
    assert 0.2 < chance < 0.3  # the top class of 40 draws from 8 balanced classes: about 0.26
    for density in (0.5, 0.2, 0.05, 0.02, 0.01):
        features, labels = _class_blind(density)
        out = topn_consistency(features, labels)
        assert out["topn_coverage_dims"] >= 16, density  # at 1 %, the dims firing in at least 40 of 4000 images
        assert out["semantic_consistency_topn"] == pytest.approx(chance, abs=0.03), density


def test_the_papers_consistency_rises_as_class_blind_features_get_sparser():
    """The defect the top-N consistency removes, pinned: the same class-blind features, sparser, score higher."""
    scores = [semantic_consistency(*_class_blind(density)) for density in (0.5, 0.2, 0.05, 0.02, 0.01)]
    assert scores == sorted(scores) and scores[0] == pytest.approx(1 / 8, abs=0.01) and scores[-1] > 0.2


def test_topn_consistency_of_features_that_copy_the_label_is_one():
    from bayesncl_pyro.evaluate.metrics import topn_consistency

    labels = torch.arange(400) % 4
    features = torch.nn.functional.one_hot(labels, 4).float() * torch.rand(400, 1) + 1e-3 * torch.rand(400, 4)
    out = topn_consistency(features, labels)  # every dim fires everywhere (the 1e-3 noise): its top 20 are its class
    assert out == dict(semantic_consistency_topn=1.0, topn_coverage_dims=4, topn_coverage_images=1.0)


def test_topn_consistency_ranks_by_value_and_counts_its_coverage():
    from bayesncl_pyro.evaluate.metrics import topn_consistency

    labels = torch.tensor([0, 1, 1, 2, 0])
    rows = torch.tensor([[0.2, 0.9], [0.9, 0.1], [0.8, 0.2], [0.0, 0.3]])
    filler = (1 - (rows ** 2).sum(dim=1, keepdim=True)).sqrt()  # rows of unit norm: normalisation changes nothing
    features = torch.cat([torch.cat([rows, filler, torch.zeros(4, 1)], dim=1), torch.tensor([[0.0, 0, 0, 1]])])
    # n = 2: dim 0's top two by value are samples 1 and 2 (class 1: 1.0; by index it would be 0 and 1: 0.5), dim 1's
    # are 0 and 3 (0.5), the filler's 3 and 2 (0.5); dim 3 fires in one sample and is not judged, nor is sample 4
    out = topn_consistency(features, labels, n=2)
    assert out["semantic_consistency_topn"] == pytest.approx(2 / 3)
    assert out["topn_coverage_dims"] == 3 and out["topn_coverage_images"] == pytest.approx(4 / 5)


def test_controls_keep_the_gates_count_in_every_image():
    from bayesncl_pyro.evaluate.matched import RANDOM_MASKS, control_masks
    from bayesncl_pyro.nn.losses import normalize

    g = torch.Generator().manual_seed(0)
    ungated = normalize(torch.rand(50, 12, generator=g) * (torch.rand(50, 12, generator=g) < 0.7))
    gates = torch.rand(50, 12, generator=g) < 0.5
    gates[:, 3] = False  # a dim F never uses
    features = normalize(ungated * gates)
    counts = (features != 0).sum(dim=1)
    masks = control_masks(ungated, features, seed=1)
    assert [len(masks[n]) for n in ("posthoc_topk", "random_per_image", "random_pruned")] == [1, RANDOM_MASKS,
                                                                                            RANDOM_MASKS]
    for name, ms in masks.items():
        for m in ms:
            assert torch.equal(m.sum(dim=1), counts), name
            assert not (m & (ungated == 0)).any(), name  # only u's non-zero entries are kept
    assert not any(m[:, 3].any() for m in masks["random_pruned"])
    assert any(m[:, 3].any() for m in masks["random_per_image"])
    # post-hoc TopK keeps each image's largest entries: every kept value is at least every dropped one
    kept = masks["posthoc_topk"][0]
    assert all(ungated[i][kept[i]].min() >= ungated[i][~kept[i]].max() for i in range(50) if 0 < counts[i] < 12)
    assert not torch.equal(masks["random_per_image"][0], masks["random_per_image"][1])  # fresh draws


def test_controls_are_seeded_and_summarised_on_both_consistencies():
    from bayesncl_pyro.evaluate.matched import count_matched_controls
    from bayesncl_pyro.nn.losses import normalize

    features, labels = _class_blind(0.5, n=400)
    gated = features * (torch.rand(400, 64, generator=torch.Generator().manual_seed(2)) < 0.5)
    a = count_matched_controls(features, gated, labels, seed=3)
    assert a == count_matched_controls(features, gated, labels, seed=3)
    for name in ("posthoc_topk", "random_per_image", "random_pruned"):
        assert {"semantic_consistency", "semantic_consistency_topn", "topn_coverage_dims", "sparsity"} <= a[name].keys()
        # F's count kept in every image, up to an entry the 1e-5 threshold sees differently after renormalising
        assert a[name]["sparsity"] == pytest.approx(sparsity(normalize(gated)), abs=1e-4)
