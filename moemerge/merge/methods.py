"""Merge methods built from the primitives; formulas in docs/merge-methods.md.

All return float32. Weights default to 1 per model; `normalize` divides by their sum, so
task_arithmetic with default weights adds λ · mean(τ).
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


def _weights(weights: Sequence[float] | None, n: int, normalize: bool) -> Tensor:
    w = torch.ones(n) if weights is None else torch.tensor(list(weights), dtype=torch.float32)
    if w.numel() != n:
        raise ValueError(f"{w.numel()} weights for {n} models")
    if normalize:
        total = w.sum()
        if total <= 0:
            raise ValueError(f"weights sum to {total.item():g}; they must sum to more than 0")
        w = w / total
    return w


def _combine(taus: Tensor, w: Tensor) -> Tensor:
    return (taus * w.reshape(-1, *([1] * (taus.dim() - 1)))).sum(dim=0)


def average(tensors: Sequence[Tensor], weights: Sequence[float] | None = None) -> Tensor:
    """Σ w_i θ_i / Σ w_i."""
    w = _weights(weights, len(tensors), normalize=True)
    return _combine(torch.stack([t.float() for t in tensors]), w)


def task_arithmetic(base: Tensor, tensors: Sequence[Tensor], weights=None, lam: float = 1.0,
                    normalize: bool = True) -> Tensor:
    """θ_base + λ Σ w_i τ_i (w normalised to sum 1 when `normalize`)."""
    w = _weights(weights, len(tensors), normalize)
    return base.float() + lam * _combine(task_vectors(base, tensors), w)


def ties(base: Tensor, tensors: Sequence[Tensor], weights=None, density: float = 0.7,
         lam: float = 1.0) -> Tensor:
    """θ_base + λ · disjoint_mean(trim(τ), elect_sign(w · trim(τ)))."""
    w = _weights(weights, len(tensors), normalize=False)
    trimmed = trim_to_density(task_vectors(base, tensors), density)
    return base.float() + lam * disjoint_mean(trimmed, elect_sign(trimmed, w), w)


def _dare(base: Tensor, tensors: Sequence[Tensor], density: float,
          generator: torch.Generator | None) -> Tensor:
    generator = generator if generator is not None else torch.Generator().manual_seed(0)
    taus = task_vectors(base, tensors)
    # one generator for the tensor, consumed in expert order: reproducible, order-independent
    return torch.stack([dare_drop(t, density, generator) for t in taus])


def dare_linear(base: Tensor, tensors: Sequence[Tensor], weights=None, density: float = 0.7,
                lam: float = 1.0, normalize: bool = True,
                generator: torch.Generator | None = None) -> Tensor:
    """θ_base + λ Σ w_i DARE(τ_i)."""
    w = _weights(weights, len(tensors), normalize)
    return base.float() + lam * _combine(_dare(base, tensors, density, generator), w)


def dare_ties(base: Tensor, tensors: Sequence[Tensor], weights=None, density: float = 0.7,
              lam: float = 1.0, generator: torch.Generator | None = None) -> Tensor:
    """θ_base + λ · disjoint_mean(DARE(τ), elect_sign(w · DARE(τ))): DARE replaces TIES's trim."""
    w = _weights(weights, len(tensors), normalize=False)
    dropped = _dare(base, tensors, density, generator)
    return base.float() + lam * disjoint_mean(dropped, elect_sign(dropped, w), w)


def merge(method: str, *, base: Tensor | None, tensors: Sequence[Tensor], weights=None,
          density: float | None = None, lam: float | None = None, normalize: bool = True,
          generator: torch.Generator | None = None) -> Tensor:
    """Dispatch by name with defaults (density 0.7, λ 1). Integer and bool tensors (buffers,
    not weights) are not averaged: the first model's is returned."""
    if method not in METHODS:
        raise ValueError(f"unknown merge method {method!r}; choose from {', '.join(METHODS)}")
    if not tensors:
        raise ValueError("nothing to merge")
    shapes = {tuple(t.shape) for t in [*tensors, *([base] if base is not None else [])]}
    if len(shapes) > 1:
        raise ValueError(f"tensors of different shapes cannot be merged: {sorted(shapes)}")
    if not tensors[0].is_floating_point():
        return tensors[0]
    if method == "average":
        return average(tensors, weights)
    if base is None:
        raise ValueError(f"{method} needs a base tensor")
    density = DEFAULT_DENSITY if density is None else density
    lam = DEFAULT_LAMBDA if lam is None else lam
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")
    if method == "task_arithmetic":
        return task_arithmetic(base, tensors, weights, lam, normalize)
    if method == "ties":
        return ties(base, tensors, weights, density, lam)
    if method == "dare_linear":
        return dare_linear(base, tensors, weights, density, lam, normalize, generator)
    return dare_ties(base, tensors, weights, density, lam, generator)
