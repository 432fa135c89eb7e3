"""RAM and RAM+ (tensor-local): task vectors merged by how many models changed each entry.
Formulas in docs/merge-methods.md.

Reinforced Agent Merging (arXiv 2601.13572) merges agents fine-tuned by RL, whose task vectors
are sparse: an entry that one model alone changed keeps that model's change (averaging it
with the zeros of the others would dilute it); an entry that several changed takes their
mean. RAM+ also scales up each model's unique entries by how much it shares with the others;
mergekit's `ramplus_tl` counts per tensor ("tensor-local"). All arithmetic in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from moemerge.merge.primitives import task_vectors

DEFAULT_THRESHOLD = 1e-5


def contributions(taus: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """Which models changed each entry (|τ_i| > threshold; [N, *shape] bool), and how many
    ([*shape] int64)."""
    changed = taus.abs() > threshold
    return changed, changed.sum(dim=0)


def ram(base: Tensor, tensors: Sequence[Tensor],
        nonzero_threshold: float = DEFAULT_THRESHOLD) -> Tensor:
    """θ_b + Σ_i m_i τ_i / max(1, c), m_i = [|τ_i| > ε], c = Σ_i m_i: per entry, the mean of
    the task vectors of the models that changed it (one model: its change as it is); entries
    no model changed by more than ε stay at the base."""
    taus = task_vectors(base, tensors)  # [N, *shape]
    changed, count = contributions(taus, nonzero_threshold)
    return base.float() + (taus * changed).sum(dim=0) / count.clamp_min(1)


def ramplus_tl(base: Tensor, tensors: Sequence[Tensor], r: float = 0.1, alpha: float = 0.2,
               nonzero_threshold: float = DEFAULT_THRESHOLD) -> Tensor:
    """RAM+, counted per tensor: model i's entries that it alone changed (c = 1) are scaled by
    λ_i = 1 + r · clamp(ρ_i, 0, α), ρ_i = shared_i / max(unique_i, ε) (its entries changed
    by others too, over those it alone changed; 0 when it shares none); shared entries take
    the mean as in RAM: θ_b + Σ_i m_i τ_i (λ_i [c = 1] + [c > 1] / c)."""
    taus = task_vectors(base, tensors)  # [N, *shape]
    changed, count = contributions(taus, nonzero_threshold)
    flat = changed.reshape(len(tensors), -1)  # [N, n]
    unique = (flat & (count.reshape(1, -1) == 1)).sum(dim=1).float()  # [N]
    shared = (flat & (count.reshape(1, -1) > 1)).sum(dim=1).float()
    rho = torch.where(shared == 0, 0.0, shared / unique.clamp_min(nonzero_threshold))
    boost = 1 + r * rho.clamp(0.0, alpha)  # [N]
    boost = boost.reshape(-1, *([1] * (taus.dim() - 1)))
    scale = torch.where(count == 1, boost, 1.0 / count.clamp_min(1))  # [N, *shape]
    return base.float() + (taus * changed * scale).sum(dim=0)
