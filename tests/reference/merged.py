"""Reference forward of merged experts (SMEAR / Lory / CAMEx; docs/merged-experts.md), one
sequence at a time, every token's FFN weights built explicitly.

For layer l and projection p: τ_i = E_i − E_m, M_i(τ) = (1/R) Σ_r (A_ir ⊗ B_ir) τ (C_ir ⊗ D_ir)ᵀ
with the ⊗ products formed by torch.kron, mask_i (TIES: sign of M_i τ_i agrees with the sign of
Σ_j M_j τ_j, which is not 0), and for a token with scores s:

    W_p = E_m + α Σ_i s_i · mask_i ⊙ M_i(τ_i)

Token t of segment k = t // T uses s = softmax(R_l · mean of the FFN inputs of segment k − 1),
or of tokens 0..t when k = 0. Dynamic: E_m^{l+1} = E_m^l + α · mean_i M_i(τ_i^l).
The non-FFN tensors are the average of the experts' (the recipe's default merge).
"""

from __future__ import annotations

import torch
from torch import nn

from reference.dense import dense

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def curvature(tau: torch.Tensor, factors: dict | None, i: int) -> torch.Tensor:
    """M_i(τ) with explicit Kronecker products; factors {A,B,C,D: [N, R, d, d]} or None (M = I)."""
    if factors is None:
        return tau
    rank = factors["A"].shape[1]
    out = torch.zeros_like(tau)
    for r in range(rank):
        left = torch.kron(factors["A"][i, r], factors["B"][i, r])
        right = torch.kron(factors["C"][i, r], factors["D"][i, r])
        out += left @ tau @ right.T
    return out / rank


def layer_deltas(reference: dict, experts: list[dict], factors: dict, mask: str):
    """-> ({p: [M_i τ_i]}, {p: [mask_i ⊙ M_i τ_i]}) for one layer."""
    curved, masked = {}, {}
    for p in PROJECTIONS:
        curved[p] = [curvature(e[p] - reference[p], factors.get(p), i)
                     for i, e in enumerate(experts)]
        if mask == "ties":
            elected = torch.sign(sum(curved[p]))
            masked[p] = [c * ((torch.sign(c) == elected) & (elected != 0)) for c in curved[p]]
        else:  # none, and dare (it only drops experts in training)
            masked[p] = curved[p]
    return curved, masked


class ReferenceFFN(nn.Module):
    """The FFN of one layer, token by token with its own merged weights."""

    def __init__(self, reference, masked, router, alpha, segment, act):
        super().__init__()
        self.reference, self.masked, self.router = reference, masked, router
        self.alpha, self.segment, self.act = alpha, segment, act

    def scores(self, h: torch.Tensor, t: int) -> torch.Tensor:
        k = t // self.segment
        window = h[: t + 1] if k == 0 else h[(k - 1) * self.segment: k * self.segment]
        return torch.softmax(self.router @ window.mean(0), dim=0)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [1, T, H]
        h, rows = hidden[0], []
        for t in range(h.shape[0]):
            s = self.scores(h, t)
            w = {p: self.reference[p] + self.alpha * sum(s_i * d for s_i, d in
                                                         zip(s, self.masked[p], strict=True))
                 for p in PROJECTIONS}
            x = h[t]
            rows.append(w["down_proj"] @ (self.act(w["gate_proj"] @ x) * (w["up_proj"] @ x)))
        return torch.stack(rows)[None]


def ffn(model, layer: int) -> dict:
    mlp = model.model.layers[layer].mlp
    return {p: getattr(mlp, p).weight.detach().clone() for p in PROJECTIONS}


def merged_experts_model(base, experts, tensors: dict, *, alpha: float, segment: int,
                         mask: str, dynamic: bool, kronecker: bool):
    """The base's dense model with averaged non-FFN weights and reference FFNs; also returns the
    baked experts E_m + M_i τ_i per layer (what `moemerge bake` must write)."""
    model, sources = dense(base), [dense(e) for e in experts]
    with torch.no_grad():
        own = dict(model.named_parameters())
        for name, param in own.items():
            if ".mlp." not in name:
                param.copy_(torch.stack([dict(s.named_parameters())[name] for s in sources])
                            .mean(0))
    baked, reference = [], None
    for layer, block in enumerate(model.model.layers):
        prefix = f"model.layers.{layer}.mlp"
        if reference is None or not dynamic:
            reference = ffn(model, layer)  # the base's FFN: E_m
        factors = {p: {f: tensors[f"{prefix}.curvature.{p}.{f}"] for f in "ABCD"}
                   for p in PROJECTIONS} if kronecker else {}
        curved, masked = layer_deltas(reference, [ffn(s, layer) for s in sources], factors, mask)
        baked.append({p: [reference[p] + c for c in curved[p]] for p in PROJECTIONS})
        block.mlp = ReferenceFFN(reference, masked, tensors[f"{prefix}.router.weight"], alpha,
                                 segment, block.mlp.act_fn)
        reference = {p: reference[p] + alpha * torch.stack(curved[p]).mean(0)
                     for p in PROJECTIONS}
    return model.eval(), baked
