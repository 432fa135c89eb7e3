"""A task vector as low-rank factors: the truncated SVD, and the share of its energy a rank keeps.

For τ = W_model − W_base [out, in] with SVD τ = U diag(s) Vᵀ, the best rank-r approximation
in Frobenius norm (Eckart–Young) is U_r diag(s_r) V_rᵀ. As a LoRA adapter it is B·A with
B = U_r diag(√s_r) [out, r] and A = diag(√s_r) V_rᵀ [r, in]: the singular values split evenly
between the two factors (mergekit-extract-lora's default), so neither factor's scale dwarfs
the other's in a low-precision dtype. The share a rank keeps is of the energy (squared
Frobenius norm): Σ_{i<r} s_i² / Σ s_i², and the approximation's relative error is
√(1 − share). Pure functions in float32 (the sums in float64); no names, no IO.
"""

from __future__ import annotations

import torch
from torch import Tensor


def singular_values(delta: Tensor) -> Tensor:
    """s of `delta` (float32, descending): what a rank is chosen on."""
    return torch.linalg.svdvals(delta.float())


def lora_factors(delta: Tensor, rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """(A [r, in], B [out, r], s [min(out, in)]) with B·A the best rank-`rank` approximation
    of `delta` [out, in], in float32 on `delta`'s device; s: all its singular values."""
    if not 1 <= rank <= min(delta.shape):
        raise ValueError(f"rank {rank} for a {list(delta.shape)} matrix")
    u, s, vh = torch.linalg.svd(delta.float(), full_matrices=False)
    root = s[:rank].sqrt()
    return root[:, None] * vh[:rank], u[:, :rank] * root, s


def energy_share(s: Tensor, rank: int) -> float:
    """Σ_{i<rank} s_i² / Σ s_i²: the share of the energy the top `rank` values keep (1 for a
    zero matrix)."""
    energy = s.double().square()
    total = float(energy.sum())
    return 1.0 if total == 0 else float(energy[:rank].sum()) / total


def rank_for_share(s: Tensor, share: float) -> int:
    """The smallest rank (at least 1) whose energy share is at least `share` (in (0, 1]);
    share 1 gives the number of non-zero singular values."""
    if not 0 < share <= 1:
        raise ValueError(f"share {share} is not in (0, 1]")
    cumulative = s.double().square().cumsum(0)
    needed = share * float(cumulative[-1])
    first = int(torch.searchsorted(cumulative, torch.tensor([needed], dtype=torch.float64)))
    return max(1, min(first + 1, len(s)))
