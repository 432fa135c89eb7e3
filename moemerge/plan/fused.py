"""Fused projections seen as their parts (Phi-3): qkv_proj stacks q, k, v and gate_up_proj
stacks gate, up, by rows. A plan that needs a part reads only its rows (Source.rows)."""

from __future__ import annotations

from moemerge.architectures import TensorRole
from moemerge.plan.shapes import projection_rows


def fused_parts(role: TensorRole, config: dict) -> dict[str, tuple[int, int]]:
    """{part: (first row, end row)} of a fused tensor ("ffn.gate_up", "attn.qkv" in dense.yaml);
    {} for a tensor that is not fused."""
    rows = projection_rows(config)
    if role.proj == "gate_up":
        inter = config["intermediate_size"]
        return {"gate": (0, inter), "up": (inter, 2 * inter)}
    if role.proj == "qkv":
        q, kv = rows["q"], rows["kv"]
        return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
    return {}
