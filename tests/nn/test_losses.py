import math

import pytest
import torch
import torch.nn.functional as F

from bayesncl_pyro.nn.losses import (
    bernoulli_kl,
    bound_logits,
    info_nce,
    info_nce_flip_differences,
    info_nce_rows,
    nonneg,
    normalize,
    topk_mask,
)


def test_info_nce_hand_computed():
    # two images, orthogonal one-hot features, identical views: every row has one positive at
    # similarity 1 and two negatives at similarity 0
    z = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    tau = 0.5
    pos, neg = math.exp(1 / tau), 2 * math.exp(0.0)
    expected = -math.log(pos / (pos + neg))
    assert info_nce(z, z, tau).item() == pytest.approx(expected, rel=1e-6)


def test_info_nce_matches_reference_formula_on_random_rows():
    torch.manual_seed(0)
    b, k, tau = 5, 7, 0.2
    z1, z2 = F.normalize(torch.randn(b, k), dim=1), F.normalize(torch.randn(b, k), dim=1)
    u = torch.cat([z1, z2])
    s = torch.exp(u @ u.T / tau)
    losses = []
    for i in range(2 * b):
        j = (i + b) % (2 * b)
        neg = sum(s[i, m] for m in range(2 * b) if m not in (i, j))
        losses.append(-torch.log(s[i, j] / (s[i, j] + neg)))
    assert info_nce(z1, z2, tau).item() == pytest.approx(torch.stack(losses).mean().item(), rel=1e-5)


def test_info_nce_rows_against_gathered_columns_equals_local():
    # under DDP each rank contrasts its rows against the rows of all ranks
    torch.manual_seed(1)
    a, b = F.normalize(torch.randn(6, 4), dim=1), F.normalize(torch.randn(6, 4), dim=1)
    cols = torch.cat([a, b])
    rows_a = info_nce_rows(a, 0.2, cols, offset=0)
    rows_b = info_nce_rows(b, 0.2, cols, offset=6)
    # the same as a single program that holds both blocks, each with its own positives
    s = cols @ cols.T / 0.2
    s.fill_diagonal_(float("-inf"))
    pos = torch.tensor([3, 4, 5, 0, 1, 2, 9, 10, 11, 6, 7, 8])
    expected = torch.logsumexp(s, 1) - s[torch.arange(12), pos]
    torch.testing.assert_close(torch.cat([rows_a, rows_b]), expected)


def test_all_zero_row_is_allowed():
    u = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
    loss = info_nce_rows(u, 0.2)
    assert torch.isfinite(loss).all()
    assert loss[0].item() == pytest.approx(math.log(3))  # three equal similarities of 0


def test_bernoulli_kl_hand_values_and_clamp():
    alpha, rho = torch.tensor([0.5, 0.9]), 0.8
    expected = [0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2),
                0.9 * math.log(0.9 / 0.8) + 0.1 * math.log(0.1 / 0.2)]
    torch.testing.assert_close(bernoulli_kl(alpha, rho, 0.01), torch.tensor(expected))
    # alpha = 0 is clamped to 0.01: finite, and equal to the KL at 0.01
    assert bernoulli_kl(torch.tensor([0.0]), rho, 0.01).item() == pytest.approx(
        bernoulli_kl(torch.tensor([0.01]), rho, 0.01).item())
    assert bernoulli_kl(torch.tensor([0.8]), 0.8, 0.01).item() == pytest.approx(0.0, abs=1e-7)


def test_rep_relu_forward_is_relu_backward_is_gelu():
    z = torch.tensor([-1.0, 0.5, 2.0], requires_grad=True)
    out = nonneg(z, "rep_relu")
    torch.testing.assert_close(out, F.relu(z))
    out.sum().backward()
    zz = z.detach().clone().requires_grad_()
    F.gelu(zz).sum().backward()
    torch.testing.assert_close(z.grad, zz.grad)
    assert z.grad[0] != 0  # an inactive unit still learns
    with pytest.raises(ValueError, match="non-negativity"):
        nonneg(z, "softplus")


def test_topk_mask_keeps_k_largest():
    z = torch.tensor([[0.1, 0.9, 0.5, 0.3], [4.0, 1.0, 2.0, 3.0]])
    torch.testing.assert_close(topk_mask(z, 2), torch.tensor([[0.0, 1, 1, 0], [1, 0, 0, 1]]))


def test_bound_logits_hold_every_gate_inside_the_bound():
    raw = torch.tensor([-1e6, -30.0, -0.01, 0.0, 0.01, 30.0, 1e6], requires_grad=True)
    bounded = bound_logits(raw, 5.0)
    assert bool((bounded.abs() <= 5.0).all()) and bounded[0] == -5.0 and bounded[-1] == 5.0
    torch.testing.assert_close(bounded[2:5], raw[2:5].detach(), atol=1e-6, rtol=1e-4)  # the identity near 0
    bounded.sum().backward()
    assert raw.grad[3] == 1.0 and bool((raw.grad >= 0).all())


def test_normalize_zero_row_has_zero_gradient():
    x = torch.tensor([[0.0, 0.0], [3.0, 4.0]], requires_grad=True)
    out = normalize(x)
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0], [0.6, 0.8]]))
    out.sum().backward()
    assert torch.equal(x.grad[0], torch.zeros(2))  # F.normalize gives 1e12 here
    y = torch.tensor([[3.0, 4.0]], requires_grad=True)
    F.normalize(y, dim=1).sum().backward()
    torch.testing.assert_close(x.grad[1], y.grad[0])  # elsewhere: F.normalize exactly
    assert normalize(torch.tensor([[float("nan"), 1.0]])).isnan().all()  # NaNs are not masked


def test_flip_differences_in_float32_hold_to_float64_at_imagenet100s_width():
    """K = 2048 (the ImageNet-100 recipe), gates 70 % open: the float32 differences the leg estimator trains with
    against the same in float64, to 5e-6 in loss units (the differences themselves reach 0.1) and 2e-4 relative
    overall; the chunked, every-flip path (a GPU's) gives the same."""
    torch.manual_seed(0)
    f = normalize(F.relu(torch.randn(64, 2048)))
    g = (torch.rand(64, 2048) < 0.7).float()
    exact = info_nce_flip_differences(f.double(), g, 0.2)
    ours = info_nce_flip_differences(f, g, 0.2)
    assert ours.dtype == torch.float32 and exact.abs().max() > 0.05
    assert (ours.double() - exact).abs().max() < 5e-6
    assert (ours.double() - exact).norm() < 2e-4 * exact.norm()
    assert torch.equal(ours[f == 0], torch.zeros_like(ours[f == 0]))
    chunked = info_nce_flip_differences(f, g, 0.2, max_elements=64 * 1000, every_flip=True)
    torch.testing.assert_close(chunked, ours, rtol=0, atol=1e-6)


@pytest.mark.slow  # two Inductor compiles, 20-60 s on 2 cores
def test_fused_flip_differences_equal_the_eager_ones():
    """The compiled chunks (a GPU's default) give the eager differences, to float32's rounding, with flips of zero
    features skipped or computed, in chunks of any size, and in float64 below temperature 0.025."""
    torch.manual_seed(0)
    f = normalize(F.relu(torch.randn(48, 40)))
    g = (torch.rand(48, 40) < 0.7).float()
    eager = info_nce_flip_differences(f, g, 0.2, fused=False)
    for every_flip, max_elements in ((False, 2**24), (True, 48 * 333)):  # 333 flips a chunk: a short last chunk
        fused = info_nce_flip_differences(f, g, 0.2, max_elements, every_flip, fused=True)
        torch.testing.assert_close(fused, eager, rtol=0, atol=1e-6)
        assert torch.equal(fused[f == 0], torch.zeros_like(fused[f == 0]))
    torch.testing.assert_close(info_nce_flip_differences(f, g, 0.02, fused=True),
                               info_nce_flip_differences(f, g, 0.02, fused=False), rtol=0, atol=1e-6)
