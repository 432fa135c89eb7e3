"""CAMEx curvature: the Kronecker application against explicit kron matrices, identity init,
the dimension split, and the TIES / DARE masks on hand-made cases."""

import pytest
import torch

from moemerge.modeling.curvature_moemerge import (
    KroneckerCurvature,
    dare_expert_mask,
    split_dim,
    ties_mask,
)


@pytest.mark.parametrize("d, expected", [(768, (24, 32)), (64, (8, 8)), (12, (3, 4)),
                                         (7, (1, 7)), (1, (1, 1))])
def test_split_dim_takes_the_largest_divisor_up_to_the_root(d, expected):
    assert split_dim(d) == expected


@pytest.mark.parametrize("rank", [1, 2])
def test_kronecker_application_equals_the_explicit_kron_product(rank):
    gen = torch.Generator().manual_seed(rank)
    n, d_out, d_in = 3, 6, 8  # 6 = 2·3, 8 = 2·4
    curvature = KroneckerCurvature(n, d_out, d_in, rank)
    with torch.no_grad():
        for factor in (curvature.A, curvature.B, curvature.C, curvature.D):
            factor.copy_(torch.randn(factor.shape, generator=gen, dtype=torch.float64).float())
    tau = torch.randn(n, d_out, d_in, generator=gen)
    expected = torch.stack([
        sum(torch.kron(curvature.A[i, r], curvature.B[i, r]) @ tau[i]
            @ torch.kron(curvature.C[i, r], curvature.D[i, r]).T for r in range(rank)) / rank
        for i in range(n)])
    torch.testing.assert_close(curvature(tau), expected, atol=1e-5, rtol=1e-5)


def test_curvature_starts_at_the_identity_exactly():
    curvature = KroneckerCurvature(2, 12, 20, rank=3)
    tau = torch.randn(2, 12, 20)
    assert torch.equal(curvature(tau), tau)


def test_ties_mask_keeps_entries_agreeing_with_the_elected_sign():
    deltas = torch.tensor([[1.0, -2.0, 0.5, 0.0],
                           [-3.0, -1.0, 0.5, 0.0]])
    # elected: sign(-2) = -, sign(-3) = -, +, 0 (no sign: nothing kept)
    assert ties_mask(deltas).tolist() == [[False, True, True, False],
                                          [True, True, True, False]]


def test_dare_mask_drops_whole_experts_and_rescales():
    mask = dare_expert_mask((4000, 3), 0.25, "cpu", torch.Generator().manual_seed(0))
    assert mask.unique().tolist() == pytest.approx([0.0, 1 / 0.75])
    assert (mask == 0).float().mean().item() == pytest.approx(0.25, abs=0.02)
