"""The steps the merging papers are made of, as pure tensor functions.

Every function takes and returns float32 tensors; τ stacks have shape [N, *shape] (one task
vector per model along the first axis). No names, no IO, no global random state.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
from torch import Tensor


def task_vectors(base: Tensor, tensors: Sequence[Tensor]) -> Tensor:
    """τ_i = θ_i − θ_base, stacked: [N, *shape]."""
    base = base.float()
    return torch.stack([t.float() - base for t in tensors])


def keep_count(numel: int, density: float) -> int:
    """How many entries TIES keeps: ceil(density · numel), at least one."""
    return max(1, min(numel, math.ceil(density * numel - 1e-9)))


def trim_to_density(taus: Tensor, density: float) -> Tensor:
    """TIES "trim": per task vector keep the top `density` fraction of entries by magnitude.

    The threshold is the k-th largest |τ| found with `kthvalue` (linear time, no sort); entries
    tied with it are kept, so slightly more than k may survive."""
    if density >= 1.0:
        return taus
    flat = taus.reshape(taus.shape[0], -1).abs()  # [N, numel]
    numel = flat.shape[1]
    k = keep_count(numel, density)
    # the (numel − k + 1)-th smallest is the k-th largest
    threshold = flat.kthvalue(numel - k + 1, dim=1, keepdim=True).values  # [N, 1]
    return (taus.reshape(flat.shape) * (flat >= threshold)).reshape(taus.shape)


def _weighted(taus: Tensor, weights: Tensor | None) -> Tensor:
    if weights is None:
        return taus
    return taus * weights.reshape(-1, *([1] * (taus.dim() - 1)))


def elect_sign(taus: Tensor, weights: Tensor | None = None) -> Tensor:
    """TIES "elect": each entry's sign is that of the (weighted) sum of the task vectors, i.e.
    the side with more total mass wins, not the side with more models. A zero sum gives 0."""
    return torch.sign(_weighted(taus, weights).sum(dim=0))


def disjoint_mean(taus: Tensor, sign: Tensor, weights: Tensor | None = None) -> Tensor:
    """TIES "disjoint merge": per entry, the weighted mean over the models whose (nonzero) τ has
    the elected sign; zeros and disagreeing entries are excluded; no agreeing model gives 0."""
    agree = (torch.sign(taus) == sign) & (taus != 0)  # [N, *shape]
    w = torch.ones(taus.shape[0]) if weights is None else weights
    w = w.reshape(-1, *([1] * (taus.dim() - 1))) * agree
    total = w.sum(dim=0)
    return (taus * w).sum(dim=0) / total.clamp_min(torch.finfo(torch.float32).tiny) * (total > 0)


def dare_drop(tau: Tensor, density: float, generator: torch.Generator, rescale: bool = True
              ) -> Tensor:
    """DARE: drop each entry with probability 1 − density; survivors × 1/density (rescale keeps
    the expectation). The mask is drawn on the CPU from `generator`, so it does not depend on
    the device. density 1 returns τ unchanged and draws nothing."""
    if density >= 1.0:
        return tau
    keep = torch.rand(tau.shape, generator=generator) < density
    dropped = tau * keep.to(tau.device)
    return dropped / density if rescale else dropped


def generator_for(seed: int, name: str) -> torch.Generator:
    """A CPU generator for one output tensor, from (recipe seed, tensor name): the same bytes
    whatever the order in which tensors are made or how many threads make them."""
    digest = hashlib.sha256(f"{seed}\x00{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
