"""CAMEx curvature and masks on expert task vectors (shipped next to the weights).

For one FFN projection with weights E_m (the reference) and E_i (N experts), τ_i = E_i − E_m
[d_out, d_in]. The curvature of expert i is Kronecker-factored, rank R:

    M_i(τ) = (1/R) Σ_r (A_ir ⊗ B_ir) · τ · (C_ir ⊗ D_ir)ᵀ

with square factors: d_out = o1·o2, d_in = i1·i2 (o1 the largest divisor of d_out not above
√d_out), A [o1, o1], B [o2, o2], C [i1, i1], D [i2, i2]. All factors start at the identity, so
M_i = I exactly (the mean over rank copies, not their sum, which would start at R·I). The
d_out·d_in × d_out·d_in matrix is never built: τ is viewed as [o1, o2, i1, i2] and each factor
contracts one axis.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def split_dim(d: int) -> tuple[int, int]:
    """(d1, d2) with d1·d2 = d and d1 the largest divisor of d not above √d (768 → 24 × 32)."""
    d1 = next(k for k in range(math.isqrt(d), 0, -1) if d % k == 0)
    return d1, d // d1


class KroneckerCurvature(nn.Module):
    """M_i for N experts of one projection [d_out, d_in]; factors [N, R, d, d]."""

    def __init__(self, num_experts: int, d_out: int, d_in: int, rank: int):
        super().__init__()
        (o1, o2), (i1, i2) = split_dim(d_out), split_dim(d_in)
        self.shape = (o1, o2, i1, i2)

        def eye(d: int) -> nn.Parameter:
            return nn.Parameter(torch.eye(d).expand(num_experts, rank, d, d).clone())

        self.A, self.B, self.C, self.D = eye(o1), eye(o2), eye(i1), eye(i2)

    def forward(self, tau: torch.Tensor) -> torch.Tensor:
        """tau [N, d_out, d_in] -> M_i(tau_i) for every i: [N, d_out, d_in]."""
        n = tau.shape[0]
        t = tau.reshape(n, *self.shape)  # [N, o1, o2, i1, i2]; row (a, b) = a·o2 + b
        t = torch.einsum("nrap,npqst->nraqst", self.A.to(t.dtype), t)  # A on the o1 axis
        t = torch.einsum("nrbq,nraqst->nrabst", self.B.to(t.dtype), t)  # B on o2
        t = torch.einsum("nrcs,nrabst->nrabct", self.C.to(t.dtype), t)  # C on i1
        t = torch.einsum("nrdt,nrabct->nrabcd", self.D.to(t.dtype), t)  # D on i2
        # τ + mean_r(K_r τ − τ) is mean_r(K_r τ), but exactly τ while every K_r = I (a plain
        # mean of R equal copies may round)
        return tau + (t - tau.reshape(n, 1, *self.shape)).mean(dim=1).reshape(tau.shape)


def ties_mask(deltas: torch.Tensor) -> torch.Tensor:
    """deltas [N, ...] -> {0, 1} mask: entries whose sign agrees with the elected sign, the sign
    of Σ_i deltas_i (TIES-CA; zeros agree with nothing)."""
    elected = torch.sign(deltas.sum(dim=0, keepdim=True))
    return (torch.sign(deltas) == elected) & (elected != 0)


def dare_expert_mask(shape: tuple[int, ...], p: float, device,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """DARE-CA: keep each expert of each segment with probability 1 − p, rescaled by 1/(1 − p):
    a [..., N] multiplier on the routing scores."""
    keep = torch.rand(shape, device=device, generator=generator) >= p
    return keep.to(torch.float32) / (1.0 - p)
