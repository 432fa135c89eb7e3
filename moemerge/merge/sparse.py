"""Task-vector methods with other sparsifiers than TIES's trim and DARE's drop: breadcrumbs
(drop the largest and the smallest), DELLA (magnitude-ranked random drop) and SCE (select by
variance, calculate weights, erase minority signs). Formulas in docs/merge-methods.md.

Each sparsifier is a pure function of a [N, *shape] stack of task vectors; the methods then end
as task arithmetic (`_linear`) or as TIES's election and disjoint mean (`consensus_merge`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from moemerge.merge.draws import Draws, draws_or_default
from moemerge.merge.methods import Weights, combine, consensus_merge, weights_of
from moemerge.merge.primitives import (
    PerModel,
    check_density,
    disjoint_mean,
    elect_sign,
    keep_count,
    on_device,
    per_model,
    rescale_kept,
    task_vectors,
)


def trim_outliers(taus: Tensor, density: PerModel, gamma: PerModel, rounding: str = "ceil",
                  bands: Tensor | None = None) -> Tensor:
    """Breadcrumbs' mask, per task vector: drop the `gamma` fraction of largest magnitudes, then
    the smallest, keeping k = keep_count(n, density) entries (fewer outliers are dropped when
    k + int(γ·n) > n); density and gamma: one for all, or one per model. Two `kthvalue`
    cut-offs, no sort; entries tied at a cut-off are kept; density 1 keeps everything.
    `bands` [N, 2] (low, high): the cut-offs found over the whole tensor, for a row block."""
    densities, gammas = per_model(density, taus.shape[0]), per_model(gamma, taus.shape[0])
    for d in densities:
        check_density(d)
    taus = taus.float()
    flat = taus.reshape(taus.shape[0], -1).abs()  # [N, n]
    if all(d == 1.0 for d in densities) or flat.shape[1] == 0:
        return taus
    if rounding == "sort":
        keep = torch.stack([_sorted_band(row, d, g)
                            for row, d, g in zip(flat, densities, gammas, strict=True)])
        return (taus.reshape(flat.shape) * keep).reshape(taus.shape)
    if bands is None:
        bands = torch.stack([_band(row, d, g, rounding)
                             for row, d, g in zip(flat, densities, gammas, strict=True)])
    bands = bands.to(flat.device)  # the blocked path's bands come from the CPU
    low, high = bands[:, :1], bands[:, 1:]
    return (taus.reshape(flat.shape) * ((flat >= low) & (flat <= high))).reshape(taus.shape)


def _sorted_band(magnitudes: Tensor, density: float, gamma: float) -> Tensor:
    """[n] bool: mergekit's `magnitude_outliers` keep mask of one flat task vector: the
    ⌊d·n⌋ entries after the n − ⌊d·n⌋ − ⌊γ·n⌋ smallest, in torch's ascending sort order (ties
    broken as that sort orders them); every entry at density 1."""
    keep = torch.zeros(magnitudes.shape, dtype=torch.bool, device=magnitudes.device)
    if density == 1.0:
        return keep.fill_(True)
    n = magnitudes.numel()
    kept, top = int(density * n), int(gamma * n)
    bottom = max(0, n - kept - top)
    keep[torch.sort(magnitudes.float(), descending=False).indices[bottom:bottom + kept]] = True
    return keep


def _band(magnitudes: Tensor, density: float, gamma: float, rounding: str) -> Tensor:
    """[low, high]: the magnitudes breadcrumbs keeps in one flat task vector."""
    if density == 1.0:
        return torch.tensor([0.0, float("inf")], device=magnitudes.device)
    n = magnitudes.numel()
    keep = keep_count(n, density, rounding)
    bottom = max(0, n - keep - int(gamma * n))  # entries dropped from below
    return torch.stack([magnitudes.kthvalue(bottom + 1).values,
                        magnitudes.kthvalue(bottom + keep).values])


def _linear(base: Tensor, taus: Tensor, w: Tensor, lam: float) -> Tensor:
    return base.float() + lam * combine(taus, w)


def breadcrumbs(base: Tensor, tensors: Sequence[Tensor], weights: Weights = None,
                density: PerModel = 0.9, gamma: PerModel = 0.01, lam: float = 1.0,
                normalize: bool = True, trim_rounding: str = "ceil",
                bands: Tensor | None = None) -> Tensor:
    """θ_base + λ Σ w̃_i Breadcrumbs_{d,γ}(τ_i)."""
    taus = trim_outliers(task_vectors(base, tensors), density, gamma, trim_rounding, bands)
    return _linear(base, taus, weights_of(weights, len(tensors), normalize), lam)


def breadcrumbs_ties(base: Tensor, tensors: Sequence[Tensor], weights: Weights = None,
                     density: PerModel = 0.9, gamma: PerModel = 0.01, lam: float = 1.0,
                     trim_rounding: str = "ceil", normalize: bool = True,
                     consensus: str = "sum", zero_vote: str = "none",
                     bands: Tensor | None = None) -> Tensor:
    """θ_base + λ · DisjointMean(Breadcrumbs(τ), Elect(w · Breadcrumbs(τ)), w)."""
    taus = trim_outliers(task_vectors(base, tensors), density, gamma, trim_rounding, bands)
    return consensus_merge(base, taus, weights_of(weights, len(tensors), False), lam,
                           normalize=normalize, consensus=consensus, zero_vote=zero_vote)


def magnitude_ranks(tau: Tensor) -> Tensor:
    """Per row ([rows, n]: the first axis, a 1-D tensor is one row), each entry's rank by
    magnitude scaled to [0, 1]: 0 for the smallest, 1 for the largest."""
    rows = tau.reshape(tau.shape[0] if tau.dim() > 1 else 1, -1).abs()
    order = rows.argsort(dim=1, stable=True)
    positions = torch.arange(rows.shape[1], dtype=rows.dtype, device=rows.device)
    ranks = torch.empty_like(rows).scatter_(1, order, positions.expand_as(rows).contiguous())
    return (ranks / on_device(max(rows.shape[1] - 1, 1), ranks)).reshape(tau.shape)


def magprune(tau: Tensor, density: float, epsilon: float, draws: Draws, model: int,
             rescale: str = "expectation", l1_scale: Tensor | None = None) -> Tensor:
    """DELLA's MagPrune: keep each entry with probability p = density − ε + 2ε · rank (rank in
    [0, 1] by magnitude within its row), so larger entries survive more often; survivors × 1/p
    ("expectation", the paper) or L1-matched ("l1", mergekit). The mask is model `model`'s of
    `draws` (merge/draws.py)."""
    check_density(density)
    tau = tau.float()
    if density == 1.0:
        return tau
    if not (0.0 < density - epsilon and density + epsilon < 1.0):
        raise ValueError(f"della: density ± epsilon must lie in (0, 1); got density {density:g},"
                         f" epsilon {epsilon:g}")
    probs = density - epsilon + 2 * epsilon * magnitude_ranks(tau)
    return rescale_kept(tau, draws.keep(model, tau, probs), probs, rescale, l1_scale)


def _magprune_all(base, tensors, density: PerModel, epsilon: PerModel, draws: Draws | None,
                  rescale, l1_scale: Tensor | None = None) -> Tensor:
    """[N, *shape] MagPruned task vectors, each at its model's density and epsilon."""
    draws = draws_or_default(draws)
    n = len(tensors)
    scales = [None] * n if l1_scale is None else list(l1_scale)
    return torch.stack([magprune(t, d, e, draws, i, rescale, s) for i, (t, d, e, s) in enumerate(
        zip(task_vectors(base, tensors), per_model(density, n), per_model(epsilon, n), scales,
            strict=True))])


def della(base: Tensor, tensors: Sequence[Tensor], weights: Weights = None,
          density: PerModel = 0.7, epsilon: PerModel = 0.15, lam: float = 1.0,
          draws: Draws | None = None, rescale: str = "expectation",
          normalize: bool = True, consensus: str = "sum", zero_vote: str = "none",
          l1_scale: Tensor | None = None) -> Tensor:
    """θ_base + λ · DisjointMean(MagPrune(τ), Elect(w · MagPrune(τ)), w)."""
    taus = _magprune_all(base, tensors, density, epsilon, draws, rescale, l1_scale)
    return consensus_merge(base, taus, weights_of(weights, len(tensors), False), lam,
                           normalize=normalize, consensus=consensus, zero_vote=zero_vote)


def della_linear(base: Tensor, tensors: Sequence[Tensor], weights: Weights = None,
                 density: PerModel = 0.7, epsilon: PerModel = 0.15, lam: float = 1.0,
                 normalize: bool = True, draws: Draws | None = None,
                 rescale: str = "expectation", l1_scale: Tensor | None = None) -> Tensor:
    """θ_base + λ Σ w̃_i MagPrune(τ_i)."""
    taus = _magprune_all(base, tensors, density, epsilon, draws, rescale, l1_scale)
    return _linear(base, taus, weights_of(weights, len(tensors), normalize), lam)


def select_by_variance(taus: Tensor, fraction: float) -> Tensor:
    """SCE "select": keep, in every task vector, the entries whose variance across the models is
    among the top `fraction` (k = int(fraction · nonzero variances), the k-th largest found with
    kthvalue, ties kept); k = 0 keeps nothing."""
    if fraction >= 1.0:
        return taus
    var = taus.var(dim=0, unbiased=False).reshape(-1)  # [n]
    k = int(int(torch.count_nonzero(var)) * fraction)
    if k == 0:
        return torch.zeros_like(taus)
    threshold = var.kthvalue(var.numel() - k + 1).values
    return taus * (var >= threshold).reshape(taus.shape[1:])


def sce_weights(taus: Tensor) -> Tensor:
    """SCE "calculate": each model's weight is its task vector's mean square, normalised to sum
    1 (uniform when they sum to less than 1e-6)."""
    energy = taus.reshape(taus.shape[0], -1).square().mean(dim=1)  # [N]
    total = energy.sum()
    return torch.full_like(energy, 1 / energy.numel()) if total < 1e-6 else energy / total


def sce(base: Tensor, tensors: Sequence[Tensor], select_topk: float = 1.0, lam: float = 1.0,
        zero_vote: str = "none") -> Tensor:
    """θ_base + λ · DisjointMean(Select(τ), Elect(Select(τ)), SCE weights): "erase" is TIES's
    sign election by mass (unweighted) and the mean over the agreeing models, SCE-weighted."""
    taus = select_by_variance(task_vectors(base, tensors), select_topk)
    sign = elect_sign(taus, None, "sum", zero_vote)
    return base.float() + lam * disjoint_mean(taus, sign, sce_weights(taus))
