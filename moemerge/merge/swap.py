"""Methods that merge one model into the base entry by entry, taking the model's value, the
base's, or a step between: NearSwap and Arcee Fusion. Formulas in docs/merge-methods.md.

Both take exactly a base θ_b and one model θ_1 of the same shape; all arithmetic in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

NEAR = 1e-6  # nearswap: differences below this count as this (no division by 0)
SOFTMAX_EPS = 1e-8  # arcee_fusion: added to both distributions before the log ratio


def nearswap(base: Tensor, tensors: Sequence[Tensor], swap_distance: float | None = None
             ) -> Tensor:
    """NearSwap (alchemonaut 2024, the QuartetAnemoi-70B-t0.0001 model card; in mergekit its
    `t`): per entry w = clamp(t / max(|θ_1 − θ_b|, 1e-6), 0, 1), result w θ_1 + (1 − w) θ_b.
    Where the two models are within t of each other the entry is the model's; elsewhere the
    base's moves by exactly t toward it (w |θ_1 − θ_b| = t): the base, pulled a bounded step
    toward the model. t = 0 gives the base."""
    if swap_distance is None:
        raise ValueError("nearswap needs swap_distance (mergekit's t); it has no default")
    b, m = base.float(), tensors[0].float()
    w = (swap_distance / (m - b).abs().clamp_min(NEAR)).clamp(0.0, 1.0)
    return w * m + (1 - w) * b


def row_kl(model: Tensor, base: Tensor) -> Tensor:
    """KL(p ‖ q) per vector along the last axis ([..., n] -> [..., 1]), p and q the softmaxes
    of the model's and the base's entries along it, each plus 1e-8."""
    p = torch.softmax(model, dim=-1) + SOFTMAX_EPS
    q = torch.softmax(base, dim=-1) + SOFTMAX_EPS
    return (p * torch.log(p / q)).sum(dim=-1, keepdim=True)


def tukey_fence(values: Tensor) -> Tensor:
    """median + 1.5 (Q3 − Q1) of all the entries (Tukey's upper outlier fence), each quartile
    the entry at 0-based rank ⌊q (n − 1)⌋ of the sorted values (no interpolation), found with
    `kthvalue` (linear time)."""
    flat = values.reshape(-1)
    last = flat.numel() - 1
    q1, median, q3 = (flat.kthvalue(quarters * last // 4 + 1).values for quarters in (1, 2, 3))
    return median + 1.5 * (q3 - q1)


def arcee_fusion(base: Tensor, tensors: Sequence[Tensor]) -> Tensor:
    """Arcee Fusion (Arcee AI 2025, in mergekit): the importance of each entry is
    |θ_1 − θ_b| times the KL divergence between the softmaxes of its row (last axis) in the
    model and in the base; the entries whose importance reaches Tukey's fence (median +
    1.5 IQR over the tensor) take the model's value, the rest keep the base's:
    θ_b + (θ_1 − θ_b) ⊙ [importance ≥ fence]. mergekit estimates the quartiles from 10⁶
    random entries when the tensor has more; moemerge uses them all (exact, deterministic)."""
    b, m = base.float(), tensors[0].float()
    delta = m - b
    importance = delta.abs() * row_kl(m, b)  # [*shape]: the row's KL broadcast along it
    return b + delta * (importance >= tukey_fence(importance))
