"""Router initialisation: the weight [E, H] of each MoE layer's gate.

The gate sees the layer's post-attention-normed hidden state h [H]; expert e's logit is w_e · h.

- random:      w_e ~ N(0, std²), std = config.initializer_range (0.02 by default): small logits,
               so top-k starts close to uniform instead of saturating as N(0, 1) would.
- prompts:     w_e = unit(c_e − mean_e' c_e'), c_e = mean h over expert e's positive prompts −
               mean h over its negative prompts, h taken at that layer's router input in the base
               model. Tokens that look like an expert's prompts score highest for it.
- cheap_embed: as prompts, but h is replaced by the mean input embedding of the prompt tokens,
               scaled by the layer's post-attention norm weight; no forward pass.
- task_vector: w_e = mean over the FFN's gate units of expert e's gate-projection task vector
               (E_e − E_base), centred across experts and scaled to unit norm: w_e · h is the
               average shift in gate pre-activation that expert e applies to h, so h goes to the
               experts whose fine-tuning opened more gates for it. Needs no prompts.
- mergekit_hidden, mergekit_hidden_avg, mergekit_cheap_embed: mergekit-moe's gate modes as
               it computes them (routing/prompts.mergekit_gate_rows), for imported configs.
Rows of prompts / cheap_embed / task_vector are unit vectors. With include_base_expert the base
expert's prompts row is zero (logit 0) and its task_vector row, τ = 0 centred, is minus the mean
of the others: it wins where no fine-tuned expert opened gates.
"""

from __future__ import annotations

import torch

from moemerge.merge.primitives import generator_for


def unit_rows(rows: torch.Tensor) -> torch.Tensor:
    norms = rows.norm(dim=-1, keepdim=True)
    return torch.where(norms > 0, rows / norms.clamp_min(1e-12), rows)


def random_router(shape: tuple[int, int], std: float, seed: int, name: str) -> torch.Tensor:
    return torch.randn(shape, generator=generator_for(seed, name)) * std


def uniform_router(shape: tuple[int, int], seed: int, name: str) -> torch.Tensor:
    """U(-1/√H, 1/√H) [E, H]: nn.Linear's default init (mergekit-moe's uniform_random)."""
    bound = shape[1] ** -0.5
    return (torch.rand(shape, generator=generator_for(seed, name)) * 2 - 1) * bound


def task_vector_router(base_gate: torch.Tensor, expert_gates: list[torch.Tensor]) -> torch.Tensor:
    """base_gate, expert_gates[e]: [I, H] gate projections -> router [E, H]."""
    base = base_gate.float()
    rows = torch.stack([(gate.float() - base).mean(dim=0) for gate in expert_gates])  # [E, H]
    if len(expert_gates) > 1:
        rows = rows - rows.mean(dim=0, keepdim=True)
    return unit_rows(rows)


def contrast_rows(
    positive: list[torch.Tensor], negative: list[torch.Tensor | None]
) -> torch.Tensor:
    """positive[e], negative[e]: mean vectors [H] (negative may be None) -> unit rows [E, H].

    Rows are centred across experts before normalising: a component shared by every row shifts
    all logits equally (softmax ignores it) but, left in, would dominate each row's norm and
    shrink the differences that do the routing."""
    rows = [p - n if n is not None else p for p, n in zip(positive, negative, strict=True)]
    stacked = torch.stack(rows).float()
    if len(rows) > 1:
        stacked = stacked - stacked.mean(dim=0, keepdim=True)
    return unit_rows(stacked)
