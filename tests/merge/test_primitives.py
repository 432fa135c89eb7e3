"""The papers' steps on cases small enough to compute by hand."""

import pytest
import torch

from moemerge.merge.draws import Draws
from moemerge.merge.primitives import (
    dare_drop,
    disjoint_mean,
    elect_sign,
    generator_for,
    keep_count,
    task_vectors,
    trim_to_density,
)

torch.set_num_threads(1)
T = torch.tensor


def test_task_vectors_stack_in_fp32():
    base = T([1.0, 2.0]).bfloat16()
    taus = task_vectors(base, [T([2.0, 2.0]), T([0.0, 5.0]).bfloat16()])
    assert taus.dtype == torch.float32
    assert torch.equal(taus, T([[1.0, 0.0], [-1.0, 3.0]]))


@pytest.mark.parametrize("numel, density, k", [
    (4, 0.5, 2), (10, 0.7, 7), (10, 0.71, 8), (3, 0.5, 2), (100, 0.001, 1), (5, 1.0, 5)])
def test_keep_count_rounds_up(numel, density, k):
    assert keep_count(numel, density) == k


def test_trim_keeps_top_magnitudes_per_task_vector():
    taus = T([[1.0, -2.0, 3.0, 0.5], [2.0, 1.0, -1.0, 0.5]])
    # τ1: |.| = [1, 2, 3, .5], top 2 are 3 and 2; τ2: the 2nd largest |.| is 1, tied: both kept
    assert torch.equal(trim_to_density(taus, 0.5), T([[0.0, -2.0, 3.0, 0.0],
                                                      [2.0, 1.0, -1.0, 0.0]]))
    assert torch.equal(trim_to_density(taus, 0.25), T([[0.0, 0.0, 3.0, 0.0],
                                                       [2.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(trim_to_density(taus, 1.0), taus)


def test_trim_matches_a_sort_on_random_matrices():
    taus = torch.randn(3, 20, 30, generator=torch.Generator().manual_seed(0))
    trimmed = trim_to_density(taus, 0.3)
    assert trimmed.shape == taus.shape
    for row, kept in zip(taus.reshape(3, -1), trimmed.reshape(3, -1), strict=True):
        top = row.abs().topk(180).indices  # ceil(0.3 · 600); no ties in random floats
        expected = torch.zeros_like(row)
        expected[top] = row[top]
        assert torch.equal(kept, expected)


def test_elect_sign_by_mass_not_count():
    taus = T([[1.0, 1.0, 2.0], [1.0, 1.0, -1.0], [-3.0, -2.0, -1.0]])
    # sums: -1 (two small + lose to one big -), 0 (a tie elects nothing), 0
    assert torch.equal(elect_sign(taus), T([-1.0, 0.0, 0.0]))
    # weights scale the mass: [1, 1, 0.5] -> sums 0.5, 1, 0.5
    assert torch.equal(elect_sign(taus, T([1.0, 1.0, 0.5])), T([1.0, 1.0, 1.0]))


def test_disjoint_mean_excludes_zeros_and_dissenters():
    taus = T([[2.0, 0.0, 1.0, 5.0], [4.0, 3.0, -2.0, 0.0]])
    sign = T([1.0, 1.0, -1.0, 0.0])
    assert torch.equal(disjoint_mean(taus, sign), T([3.0, 3.0, -2.0, 0.0]))
    # weighted: (1·2 + 3·4) / 4 = 3.5 in entry 0; single agreeing models are unaffected
    assert torch.equal(disjoint_mean(taus, sign, T([1.0, 3.0])), T([3.5, 3.0, -2.0, 0.0]))


def test_dare_drop_by_hand():
    tau = T([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    keep = Draws.of(3, "w").uniform(1, (6,)) < 0.5
    assert torch.equal(dare_drop(tau, 0.5, Draws.of(3, "w"), 1), tau * keep / 0.5)
    assert torch.equal(dare_drop(tau, 0.5, Draws.of(3, "w"), 1, rescale=False), tau * keep)
    assert not torch.equal(dare_drop(tau, 0.5, Draws.of(3, "w"), 0), tau * keep / 0.5)


def test_dare_density_one_is_identity():
    tau = torch.randn(5)
    assert torch.equal(dare_drop(tau, 1.0, Draws.of(0, "t"), 0), tau)


def test_dare_is_unbiased_over_many_draws():
    tau = T([2.0, -1.0, 0.5, 4.0])
    draws = dare_drop(tau.expand(20_000, 4), 0.3, Draws.of(0, "many"), 0)  # [draws, 4]
    torch.testing.assert_close(draws.mean(dim=0), tau, atol=0.1, rtol=0.05)
    assert abs((draws != 0).float().mean().item() - 0.3) < 0.01


def test_bad_density():
    for density in (0.0, -0.5, 1.01):
        with pytest.raises(ValueError, match="density"):
            trim_to_density(torch.ones(2, 2), density)
        with pytest.raises(ValueError, match="density"):
            dare_drop(torch.ones(2), density, Draws.of(0, "x"), 0)


def test_generator_seed_is_pinned():
    # sha256("0\x00x")[:8] little-endian, top bit cleared. Changing the derivation would
    # silently change every DARE build and router init: pin it.
    assert generator_for(0, "x").initial_seed() == 6954302760706977299
    assert generator_for(0, "x").initial_seed() != generator_for(0, "y").initial_seed()
    assert generator_for(0, "x").initial_seed() != generator_for(1, "x").initial_seed()
    assert generator_for(0, "x").device == torch.device("cpu")


def _mergekit_magnitude_mask(tau, density):
    """mergekit 0.1.5's `magnitude` sparsifier, written plainly: the first max(1, ⌊d·n⌋)
    entries of a descending argsort of the flat float32 magnitudes."""
    w = tau.abs().reshape(-1).float()
    mask = torch.zeros(w.numel(), dtype=torch.bool)
    mask[torch.argsort(w, descending=True)[:max(1, int(density * w.numel()))]] = True
    return mask.reshape(tau.shape)


def _mergekit_outliers_mask(tau, density, gamma):
    """mergekit 0.1.5's `magnitude_outliers`, written plainly."""
    w = tau.abs().reshape(-1).float()
    n = w.numel()
    kept, bottom = int(density * n), max(0, n - int(density * n) - int(gamma * n))
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.sort(w, descending=False).indices[bottom:bottom + kept]] = True
    return mask.reshape(tau.shape)


@pytest.mark.parametrize("density", [0.3, 0.5, 0.9])
def test_sorted_cut_keeps_exactly_mergekits_entries_ties_included(density):
    """bf16-valued task vectors hold many equal magnitudes: at the cut-off, `trim_rounding:
    sort` keeps exactly the entries mergekit keeps; `floor` keeps every tied one (more, and
    others). Checked against mergekit 0.1.5 itself too (issue 30 note): 0 entries apart."""
    from moemerge.merge.sparse import trim_outliers

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(300, 97, generator=gen).bfloat16()
    taus = torch.stack([(base.float() + 0.05 * torch.randn(300, 97, generator=gen))
                        .bfloat16().float() - base.float() for _ in range(3)])
    want = torch.stack([_mergekit_magnitude_mask(t, density) for t in taus])
    assert torch.equal(trim_to_density(taus, density, "sort") != 0, want & (taus != 0))
    assert not torch.equal(trim_to_density(taus, density, "floor") != 0, want & (taus != 0))
    want = torch.stack([_mergekit_outliers_mask(t, density, 0.05) for t in taus])
    assert torch.equal(trim_outliers(taus, density, 0.05, "sort") != 0, want & (taus != 0))
    assert not torch.equal(trim_outliers(taus, density, 0.05, "floor") != 0, want & (taus != 0))
