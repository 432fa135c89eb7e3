"""Merge methods built from the primitives; formulas in docs/merge-methods.md.

All compute in and return float32. Weights default to 1 per model; `normalize` divides them by
their sum, so task_arithmetic with default weights adds λ · mean(τ). In TIES and DARE-TIES the
weights multiply τ before the sign election and weight the disjoint mean (a weighted mean
already, so `normalize` changes nothing there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from moemerge.merge.primitives import (
    dare_drop,
    disjoint_mean,
    elect_sign,
    task_vectors,
    trim_to_density,
)

METHODS = ("average", "task_arithmetic", "ties", "dare_linear", "dare_ties")
NEEDS_BASE = frozenset({"task_arithmetic", "ties", "dare_linear", "dare_ties"})
DEFAULT_DENSITY = 0.7
DEFAULT_LAMBDA = 1.0
Weights = Sequence[float] | Tensor | None


def _weights(weights: Weights, n: int, normalize: bool) -> Tensor:
    """[n] float32 weights (default all 1), divided by their sum when `normalize`."""
    if weights is None:
        w = torch.ones(n)
    else:
        w = torch.tensor([float(x) for x in weights], dtype=torch.float32)
    if w.numel() != n:
        raise ValueError(f"{w.numel()} weights for {n} models")
    total = w.sum()
    if total <= 0:
        raise ValueError(f"weights sum to {total.item():g}; they must sum to more than 0")
    return w / total if normalize else w


def _combine(stack: Tensor, w: Tensor) -> Tensor:
    """Σ_i w_i · stack_i over the first axis: [N, *shape] -> [*shape]."""
    return (stack * w.to(stack.device).reshape(-1, *([1] * (stack.dim() - 1)))).sum(dim=0)


def _weighted_sum(tensors: Sequence[Tensor], w: Tensor) -> Tensor:
    """Σ_i w_i · t_i accumulated in place: one pass over each input, no [N, *shape] stack (the
    linear methods are memory-bound, and a stack triples their traffic)."""
    out = tensors[0].float() * w[0].item()
    for t, wi in zip(tensors[1:], w[1:].tolist(), strict=True):
        out.add_(t.float(), alpha=wi)
    return out


def average(tensors: Sequence[Tensor], weights: Weights = None) -> Tensor:
    """Σ w_i θ_i / Σ w_i."""
    return _weighted_sum(tensors, _weights(weights, len(tensors), normalize=True))


def task_arithmetic(base: Tensor, tensors: Sequence[Tensor], weights: Weights = None,
                    lam: float = 1.0, normalize: bool = True) -> Tensor:
    """θ_base + λ Σ w_i τ_i (w normalised to sum 1 when `normalize`)."""
    w = _weights(weights, len(tensors), normalize)
    out = _weighted_sum(tensors, w * lam)  # λ Σ w_i θ_i ...
    return out.add_(base.float(), alpha=1.0 - lam * w.sum().item())  # ... + (1 − λ Σ w_i) θ_b


def ties(base: Tensor, tensors: Sequence[Tensor], weights: Weights = None,
         density: float = DEFAULT_DENSITY, lam: float = DEFAULT_LAMBDA) -> Tensor:
    """θ_base + λ · disjoint_mean(trim(τ), elect_sign(w · trim(τ)), w)."""
    w = _weights(weights, len(tensors), normalize=False)
    trimmed = trim_to_density(task_vectors(base, tensors), density)  # [N, *shape]
    return base.float() + lam * disjoint_mean(trimmed, elect_sign(trimmed, w), w)


def _dare(base: Tensor, tensors: Sequence[Tensor], density: float,
          generator: torch.Generator | None) -> Tensor:
    """[N, *shape] dropped-and-rescaled task vectors. One generator for the output tensor,
    consumed in expert order; None means a fixed seed 0 (reproducible, never the global RNG)."""
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    return torch.stack([dare_drop(t, density, generator) for t in task_vectors(base, tensors)])


def dare_linear(base: Tensor, tensors: Sequence[Tensor], weights: Weights = None,
                density: float = DEFAULT_DENSITY, lam: float = DEFAULT_LAMBDA,
                normalize: bool = True, generator: torch.Generator | None = None) -> Tensor:
    """θ_base + λ Σ w_i DARE(τ_i)."""
    w = _weights(weights, len(tensors), normalize)
    return base.float() + lam * _combine(_dare(base, tensors, density, generator), w)


def dare_ties(base: Tensor, tensors: Sequence[Tensor], weights: Weights = None,
              density: float = DEFAULT_DENSITY, lam: float = DEFAULT_LAMBDA,
              generator: torch.Generator | None = None) -> Tensor:
    """θ_base + λ · disjoint_mean(DARE(τ), elect_sign(w · DARE(τ)), w): DARE replaces the trim."""
    w = _weights(weights, len(tensors), normalize=False)
    dropped = _dare(base, tensors, density, generator)
    return base.float() + lam * disjoint_mean(dropped, elect_sign(dropped, w), w)


def merge(method: str, *, base: Tensor | None, tensors: Sequence[Tensor], weights: Weights = None,
          density: float | None = None, lam: float | None = None, normalize: bool = True,
          generator: torch.Generator | None = None) -> Tensor:
    """Validate, apply the defaults (density 0.7, λ 1) and dispatch by name.

    Integer and bool tensors (position ids, masks: buffers, not weights) are not merged: the
    first model's is returned unchanged. `average` ignores `base`."""
    if method not in METHODS:
        raise ValueError(f"unknown merge method {method!r}; choose from {', '.join(METHODS)}")
    if not tensors:
        raise ValueError("nothing to merge")
    needs_base = method in NEEDS_BASE
    if needs_base and base is None:
        raise ValueError(f"{method} needs a base tensor")
    shapes = {tuple(t.shape) for t in tensors}
    if needs_base:
        shapes.add(tuple(base.shape))
    if len(shapes) > 1:
        raise ValueError(f"tensors of different shapes cannot be merged: {sorted(shapes)}")
    density = DEFAULT_DENSITY if density is None else density
    lam = DEFAULT_LAMBDA if lam is None else lam
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    _weights(weights, len(tensors), normalize=False)  # checks length and sum for every method
    if not tensors[0].is_floating_point():
        return tensors[0]
    if method == "average":
        return average(tensors, weights)
    if method == "task_arithmetic":
        return task_arithmetic(base, tensors, weights, lam, normalize)
    if method == "ties":
        return ties(base, tensors, weights, density, lam)
    if method == "dare_linear":
        return dare_linear(base, tensors, weights, density, lam, normalize, generator)
    return dare_ties(base, tensors, weights, density, lam, generator)
