"""Merge methods built from the primitives; formulas in docs/merge-methods.md.

All compute in and return float32. Weights default to 1 per model; `normalize` divides them by
their sum, so task_arithmetic with default weights adds λ · mean(τ). In TIES and DARE-TIES the
weights multiply τ before the sign election and weight the disjoint mean (a weighted mean;
`normalize: false` makes it the weighted sum of the agreeing entries instead). The dispatcher
that applies a recipe's parameters is moemerge/merge/dispatch.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from moemerge.merge.draws import Draws, draws_or_default
from moemerge.merge.primitives import (
    PerModel,
    dare_drop,
    disjoint_mean_,
    elect_sign,
    per_model,
    task_vectors,
    trim_to_density,
)
from moemerge.words import plural

DEFAULT_DENSITY = 0.7
DEFAULT_LAMBDA = 1.0
Weights = Sequence[float] | Tensor | None


def weights_of(weights: Weights, n: int, normalize: bool) -> Tensor:
    """[n] float32 weights (default all 1), divided by their sum when `normalize` (which must
    then be above 0; signed weights are checked against the method in merge/dispatch.py)."""
    if weights is None:
        w = torch.ones(n)
    else:
        w = torch.tensor([float(x) for x in weights], dtype=torch.float32)
    if w.numel() != n:
        raise ValueError(f"{plural(w.numel(), 'weight')} for {plural(n, 'model')}")
    if not normalize:
        return w
    total = w.sum()
    if total <= 0:
        raise ValueError(f"weights sum to {total.item():g}; normalized weights must sum to more "
                         "than 0")
    return w / total


def combine(stack: Tensor, w: Tensor) -> Tensor:
    """Σ_i w_i · stack_i over the first axis: [N, *shape] -> [*shape]."""
    return (stack * w.to(stack.device).reshape(-1, *([1] * (stack.dim() - 1)))).sum(dim=0)


def _weighted_sum(tensors: Sequence[Tensor], w: Tensor) -> Tensor:
    """Σ_i w_i · t_i accumulated in place: one pass over each input, no [N, *shape] stack (the
    linear methods are memory-bound, and a stack triples their traffic)."""
    out = tensors[0].float() * w[0].item()
    for t, wi in zip(tensors[1:], w[1:].tolist(), strict=True):
        out.add_(t.float(), alpha=wi)
    return out


def average(tensors: Sequence[Tensor], weights: Weights = None, normalize: bool = True) -> Tensor:
    """Σ w_i θ_i / Σ w_i; without `normalize` the weighted sum Σ w_i θ_i (mergekit's linear with
    normalize: false)."""
    return _weighted_sum(tensors, weights_of(weights, len(tensors), normalize))


def task_arithmetic(base: Tensor, tensors: Sequence[Tensor], weights: Weights = None,
                    lam: float = 1.0, normalize: bool = True) -> Tensor:
    """θ_base + λ Σ w_i τ_i (w normalised to sum 1 when `normalize`)."""
    w = weights_of(weights, len(tensors), normalize)
    out = _weighted_sum(tensors, w * lam)  # λ Σ w_i θ_i ...
    return out.add_(base.float(), alpha=1.0 - lam * w.sum().item())  # ... + (1 − λ Σ w_i) θ_b


def consensus_merge(base: Tensor, taus: Tensor, w: Tensor, lam: float, *, normalize: bool = True,
                    consensus: str = "sum", zero_vote: str = "none") -> Tensor:
    """θ_base + λ · disjoint_mean(τ, elect_sign(w · τ), w): the second half of every
    sign-consensus method (TIES, DARE-TIES, breadcrumbs-TIES, DELLA), after its own sparsifier.
    `taus` is the sparsifier's fresh stack, overwritten here (no copy of it is made)."""
    from moemerge.merge import native  # (it imports this module)

    fast = native.consensus(base, taus, w, lam, normalize=normalize, consensus=consensus,
                            zero_vote=zero_vote)
    if fast is not None:  # the same bytes, one pass
        return fast
    sign = elect_sign(taus, w, consensus, zero_vote)
    return base.float() + lam * disjoint_mean_(taus.float(), sign, w, normalize)


def ties(base: Tensor, tensors: Sequence[Tensor], weights: Weights = None,
         density: PerModel = DEFAULT_DENSITY, lam: float = DEFAULT_LAMBDA,
         trim_rounding: str = "ceil", normalize: bool = True, consensus: str = "sum",
         zero_vote: str = "none", thresholds: Tensor | None = None) -> Tensor:
    """θ_base + λ · disjoint_mean(trim(τ), elect_sign(w · trim(τ)), w). `thresholds`: the
    trim's cut-offs found over the whole tensor, when this is one row block of it."""
    w = weights_of(weights, len(tensors), normalize=False)
    trimmed = trim_to_density(task_vectors(base, tensors), density, trim_rounding, thresholds)
    return consensus_merge(base, trimmed, w, lam, normalize=normalize, consensus=consensus,
                           zero_vote=zero_vote)


def _dare(base: Tensor, tensors: Sequence[Tensor], density: PerModel, draws: Draws | None,
          rescale: str = "expectation", l1_scale: Tensor | None = None) -> Tensor:
    """[N, *shape] dropped-and-rescaled task vectors, each at its model's density, model i's
    mask the i-th of the output tensor's `draws` (None: fixed draws, never the global RNG).
    `l1_scale` [N]: the whole tensor's L1 factors, when this is one row block of it."""
    draws = draws_or_default(draws)
    scales = [None] * len(tensors) if l1_scale is None else list(l1_scale)
    return torch.stack([dare_drop(t, d, draws, i, rescale, s) for i, (t, d, s) in enumerate(zip(
        task_vectors(base, tensors), per_model(density, len(tensors)), scales, strict=True))])


def dare_linear(base: Tensor, tensors: Sequence[Tensor], weights: Weights = None,
                density: PerModel = DEFAULT_DENSITY, lam: float = DEFAULT_LAMBDA,
                normalize: bool = True, draws: Draws | None = None,
                rescale: str = "expectation", l1_scale: Tensor | None = None) -> Tensor:
    """θ_base + λ Σ w_i DARE(τ_i)."""
    w = weights_of(weights, len(tensors), normalize)
    return base.float() + lam * combine(_dare(base, tensors, density, draws, rescale,
                                              l1_scale), w)


def dare_ties(base: Tensor, tensors: Sequence[Tensor], weights: Weights = None,
              density: PerModel = DEFAULT_DENSITY, lam: float = DEFAULT_LAMBDA,
              draws: Draws | None = None, rescale: str = "expectation",
              normalize: bool = True, consensus: str = "sum", zero_vote: str = "none",
              l1_scale: Tensor | None = None) -> Tensor:
    """θ_base + λ · disjoint_mean(DARE(τ), elect_sign(w · DARE(τ)), w): DARE replaces the trim."""
    w = weights_of(weights, len(tensors), normalize=False)
    dropped = _dare(base, tensors, density, draws, rescale, l1_scale)
    return consensus_merge(base, dropped, w, lam, normalize=normalize, consensus=consensus,
                           zero_vote=zero_vote)
