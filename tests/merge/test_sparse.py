"""Breadcrumbs, DELLA, SCE and the switchable mergekit conventions, on cases computed by hand."""

import torch

from moemerge.merge.dispatch import merge
from moemerge.merge.draws import Draws
from moemerge.merge.methods import dare_linear, ties
from moemerge.merge.primitives import dare_drop, keep_count, trim_to_density
from moemerge.merge.sparse import (
    breadcrumbs,
    breadcrumbs_ties,
    della,
    della_linear,
    magnitude_ranks,
    magprune,
    sce,
    sce_weights,
    select_by_variance,
    trim_outliers,
)

torch.set_num_threads(1)
T = torch.tensor
Z5 = torch.zeros(5)
A, B = T([1.0, -2.0, 3.0, 0.5, 4.0]), T([-1.0, 0.1, 2.0, -3.0, 0.2])


def test_breadcrumbs_drops_the_largest_and_the_smallest():
    # density 0.6 keeps 3 of 5, gamma 0.2 drops int(1) largest, so 1 smallest goes too:
    #   |A| sorted .5 1 2 3 4: keep 1 2 3; |B| sorted .1 .2 1 2 3: keep .2 1 2
    trimmed = trim_outliers(torch.stack([A, B]), 0.6, 0.2)
    assert torch.equal(trimmed, T([[1.0, -2.0, 3.0, 0.0, 0.0], [-1.0, 0.0, 2.0, 0.0, 0.2]]))
    # floor: int(0.5 · 5) = 2 kept, 1 outlier, 2 smallest dropped
    assert torch.equal(trim_outliers(A[None], 0.5, 0.2, "floor"), T([[0.0, -2.0, 3.0, 0.0, 0.0]]))
    # gamma gives way to the density: density 1 keeps everything
    assert torch.equal(trim_outliers(A[None], 1.0, 0.2), A[None])
    assert torch.equal(breadcrumbs(Z5, [A, B], density=0.6, gamma=0.2),
                       T([0.0, -1.0, 2.5, 0.0, 0.1]))
    assert torch.equal(breadcrumbs(Z5, [A, B], density=0.6, gamma=0.2, normalize=False),
                       T([0.0, -2.0, 5.0, 0.0, 0.2]))


def test_breadcrumbs_ties_elects_signs_on_the_kept_entries():
    # kept sum [0, -2, 5, 0, .2]: signs [0, -, +, 0, +]; entry 0 is a zero vote (1 - 1)
    out = breadcrumbs_ties(Z5, [A, B], density=0.6, gamma=0.2)
    assert torch.equal(out, T([0.0, -2.0, 2.5, 0.0, 0.2]))
    out = breadcrumbs_ties(Z5, [A, B], density=0.6, gamma=0.2, zero_vote="positive")
    assert torch.equal(out, T([1.0, -2.0, 2.5, 0.0, 0.2]))


def test_magprune_keep_probabilities_follow_the_magnitude_rank():
    tau = T([[1.0, -3.0, 2.0], [0.5, 0.1, -0.2]])
    assert torch.equal(magnitude_ranks(tau), T([[0.0, 1.0, 0.5], [1.0, 0.0, 0.5]]))
    assert torch.equal(magnitude_ranks(T([1.0, -3.0, 2.0])), T([0.0, 1.0, 0.5]))
    # density .5, epsilon .2: p = .3 + .4 · rank = [.3, .7, .5] in the first row
    probs = T([[0.3, 0.7, 0.5], [0.7, 0.3, 0.5]])
    u = Draws.of(3, "w").uniform(0, (2, 3))
    expected = tau * (u < probs) / probs
    out = magprune(tau, 0.5, 0.2, Draws.of(3, "w"), 0)
    torch.testing.assert_close(out, expected, atol=0, rtol=1e-6)  # .3 + .4 · 1 vs .7: 1 ulp
    kept = tau * (u < probs)
    l1 = magprune(tau, 0.5, 0.2, Draws.of(3, "w"), 0, rescale="l1")
    torch.testing.assert_close(l1, kept * tau.abs().sum() / kept.abs().sum())


def test_della_with_zero_epsilon_is_dare():
    gen = torch.Generator().manual_seed(0)
    base, a, b = (torch.randn(8, 16, generator=gen) for _ in range(3))
    out = della_linear(base, [a, b], density=0.6, epsilon=0.0, draws=Draws.of(1, "x"))
    expected = dare_linear(base, [a, b], density=0.6, draws=Draws.of(1, "x"))
    torch.testing.assert_close(out, expected, atol=1e-7, rtol=0)
    out = della(base, [a, b], density=0.6, epsilon=0.0, draws=Draws.of(1, "x"))
    expected = merge("dare_ties", base=base, tensors=[a, b], density=0.6,
                     draws=Draws.of(1, "x"))
    torch.testing.assert_close(out, expected, atol=1e-7, rtol=0)


def test_della_end_to_end_by_hand():
    # density .5, epsilon .2: p = .3 + .4 · rank, ranks by |τ| within the tensor
    #   |A| = 1 2 3 .5 4  -> ranks .25 .5 .75 0 1 -> p = .4 .5 .6 .3 .7
    #   |B| = 1 .1 2 3 .2 -> ranks .5 0 .75 1 .25 -> p = .5 .3 .6 .7 .4
    pa, pb = T([0.4, 0.5, 0.6, 0.3, 0.7]), T([0.5, 0.3, 0.6, 0.7, 0.4])
    draws = Draws.of(227, "t")  # the draws of one output tensor: A's are model 0's, B's 1's
    ua, ub = draws.uniform(0, (5,)), draws.uniform(1, (5,))
    assert (ua < pa).tolist() == [False, True, False, False, True]  # the draws of this seed
    assert (ub < pb).tolist() == [True, False, True, True, True]
    # survivors / p: A' = [0, -2/.5, 0, 0, 4/.7], B' = [-1/.5, 0, 2/.6, -3/.7, .2/.4]
    a_kept, b_kept = T([0.0, -4.0, 0.0, 0.0, 40 / 7]), T([-2.0, 0.0, 10 / 3, -30 / 7, 0.5])
    base = T([1.0, -1.0, 0.5, 2.0, 0.0])
    out = merge("della", base=base, tensors=[base + A, base + B], weights=[1.0, 2.0],
                density=0.5, epsilon=0.2, lam=0.5, draws=Draws.of(227, "t"))
    # elected signs of 1·A' + 2·B' = [-4, -4, 20/3, -60/7, 47/7]: - - + - +; disjoint weighted
    # mean of the agreeing nonzero entries: only entry 4 has both, (1·40/7 + 2·.5) / 3 = 47/21
    merged = T([-2.0, -4.0, 10 / 3, -30 / 7, 47 / 21])
    torch.testing.assert_close(out, base + 0.5 * merged, atol=1e-6, rtol=0)
    # della_linear: the weighted mean (1·A' + 2·B') / 3, no election
    out = merge("della_linear", base=base, tensors=[base + A, base + B], weights=[1.0, 2.0],
                density=0.5, epsilon=0.2, lam=0.5, draws=Draws.of(227, "t"))
    assert torch.allclose((a_kept + 2 * b_kept) / 3, T([-4 / 3, -4 / 3, 20 / 9, -20 / 7, 47 / 21]))
    torch.testing.assert_close(out, base + 0.5 * (a_kept + 2 * b_kept) / 3, atol=1e-6, rtol=0)


def test_della_refuses_probabilities_outside_0_1():
    try:
        magprune(T([1.0, 2.0]), 0.9, 0.15, Draws.of(0, "x"), 0)
    except ValueError as exc:
        assert "density ± epsilon" in str(exc)
    else:
        raise AssertionError("no error")


def test_sce_selects_by_variance_weights_by_energy_and_erases_minority_signs():
    t1, t2 = T([1.0, 2.0, -1.0, 0.0]), T([3.0, -2.0, -1.0, 0.0])
    taus = torch.stack([t1, t2])
    # variances [1, 4, 0, 0]: 2 nonzero, top int(2 · .5) = 1 is entry 1
    assert torch.equal(select_by_variance(taus, 0.5), T([[0.0, 2.0, 0.0, 0.0],
                                                         [0.0, -2.0, 0.0, 0.0]]))
    # mean squares 1.5 and 3.5 -> weights .3, .7
    torch.testing.assert_close(sce_weights(taus), T([0.3, 0.7]))
    # signs of the sums [4, 0, -2, 0]: entry 0 (.3 · 1 + .7 · 3) = 2.4; entry 1 a zero vote
    torch.testing.assert_close(sce(torch.zeros(4), [t1, t2]), T([2.4, 0.0, -1.0, 0.0]))
    torch.testing.assert_close(sce(torch.zeros(4), [t1, t2], zero_vote="positive"),
                               T([2.4, 2.0, -1.0, 0.0]))
    assert torch.equal(sce(torch.zeros(4), [t1, t2], select_topk=0.5), torch.zeros(4))


E1, E2 = T([1.0, -2.0, 3.0, 0.5]), T([2.0, 1.0, -1.0, 0.5])
ZERO = torch.zeros(4)


def test_ties_conventions_switch_to_mergekits():
    assert keep_count(5, 0.6) == 3 and keep_count(5, 0.6, "floor") == 3
    assert keep_count(4, 0.6) == 3 and keep_count(4, 0.6, "floor") == 2
    taus = torch.stack([E1, E2])
    assert torch.equal(trim_to_density(taus, 0.6, "floor"), trim_to_density(taus, 0.5))
    # weights [1, 3] at density .5: entry 2's vote 3 - 3 = 0 elects nothing, or + (mergekit)
    assert torch.equal(ties(ZERO, [E1, E2], weights=[1, 3], density=0.5, zero_vote="positive"),
                       T([2.0, 1.0, 3.0, 0.0]))
    # by count: trimmed signs [+, 0], [-, +], [+, -]: entries 1 and 2 tie at 0
    assert torch.equal(ties(ZERO, [E1, E2], density=0.5, consensus="count"),
                       T([2.0, 0.0, 0.0, 0.0]))
    up1, up2 = T([1.0, 2.0]), T([3.0, 4.0])
    assert torch.equal(ties(torch.zeros(2), [up1, up2], density=1.0), T([2.0, 3.0]))
    assert torch.equal(ties(torch.zeros(2), [up1, up2], density=1.0, normalize=False),
                       T([4.0, 6.0]))


def test_dare_l1_rescale_matches_the_norm():
    tau = torch.randn(64, generator=torch.Generator().manual_seed(2))
    keep = Draws.of(0, "d").uniform(0, (64,)) < 0.5
    out = dare_drop(tau, 0.5, Draws.of(0, "d"), 0, rescale="l1")
    torch.testing.assert_close(out, tau * keep * (tau.abs().sum() / (tau * keep).abs().sum()))
    torch.testing.assert_close(out.abs().sum(), tau.abs().sum())
    none = dare_drop(tau, 0.5, Draws.of(0, "d"), 0, rescale="none")
    assert torch.equal(none, tau * keep)
