"""The always-on shared expert of token-routed layouts that have one (Qwen2-MoE,
GraniteMoeShared).

Qwen2-MoE's FFN is  routed(x) + sigmoid(g . x) * shared(x),  with g = shared_expert_gate [1, H]
and x the post-attention-normed hidden state. The recipe's `shared_expert` picks `shared`:

  none     zeros of width 1: adds nothing, so identical experts still give the dense logits.
  base     the base model's FFN; average  the experts' FFN average (weighted like the experts).

g starts as N(0, std²) with std = GATE_SCALE / sqrt(H): g . x ~ N(0, (GATE_SCALE · rms(x))²),
so sigmoid(g . x) ≈ 0.5 for every token and the gate is free to move either way when trained.
The gate has no bias, so no row makes sigmoid(g . x) small for every x; ≈ 0.5 is the neutral
start, and with `base` the FFN begins as  routed(x) + ½ FFN_base(x)  (docs/recipes.md). g is
never all zeros: llama.cpp evaluates this sigmoid as silu(z) / z, which is 0 / 0 = NaN at z = 0.

GraniteMoeShared adds its shared MLP with no gate: routed(x) + shared(x). Granite sources with
`shared_expert: none` become a GraniteMoE (no shared MLP at all) instead.
"""

from __future__ import annotations

import math

from moemerge.architectures.tables import MoELayout
from moemerge.errors import RecipeError
from moemerge.plan.common import merge_job
from moemerge.plan.jobs import Job, Source
from moemerge.plan.sources import SourceModel
from moemerge.recipe.merge import MergeSpec
from moemerge.recipe.models import MoERecipe

GATE_SCALE = 0.01


def check_shared_expert(recipe: MoERecipe, layout: MoELayout) -> None:
    if recipe.shared_expert != "none" and layout.shared_expert is None:
        raise RecipeError(
            f"shared_expert: {recipe.shared_expert!r} needs an output layout with a shared expert "
            f"(qwen2_moe from Qwen2 sources, granitemoeshared from Granite sources); this "
            f"base becomes {layout.name}, which has none. "
            "Remove shared_expert or use shared_expert: none."
        )


def shared_expert_jobs(recipe: MoERecipe, layout: MoELayout, base: SourceModel, layer: int,
                       dtype, experts: list[int]) -> list[Job]:
    """The shared expert's projections and its gate in `layer` (none if the layout has none)."""
    if layout.shared_expert is None:
        return []
    if recipe.shared_expert == "none":
        return zeroed_shared_expert(layout, base, layer, dtype)
    jobs = []
    for proj, name in _ffn(base, layer):
        output = layout.shared_name(layer, proj)
        shape = base.reader.meta(name).shape
        if recipe.shared_expert == "base":
            jobs.append(Job(output, shape, dtype, "copy", "ffn", layer, (Source(0, name),)))
        else:  # the experts' FFN average, with the recipe's expert weights
            jobs.append(merge_job(name, "ffn", layer, shape, dtype, MergeSpec(), experts,
                                  recipe.experts, None, output=output))
    return [*jobs, *_gate(layout, base, layer, dtype)]


def zeroed_shared_expert(layout: MoELayout, base: SourceModel, layer: int,
                         dtype) -> list[Job]:
    """A shared expert of width 1 and all zeros (its output is 0, so the logits are the routed
    experts' alone) behind a gate that is never exactly zero (llama.cpp); none if the layout has
    no shared expert."""
    if layout.shared_expert is None:
        return []
    hidden = base.config["hidden_size"]
    jobs = [Job(layout.shared_name(layer, proj), (hidden, 1) if proj == "down" else (1, hidden),
                dtype, "zeros", "ffn", layer) for proj, _ in _ffn(base, layer)]
    return [*jobs, *_gate(layout, base, layer, dtype)]


def _ffn(base: SourceModel, layer: int) -> list[tuple[str, str]]:
    """(projection, tensor name) of the base's FFN in `layer`."""
    return sorted((r.proj, n) for n, r in base.roles.items()
                  if r.layer == layer and r.role == "ffn")


def _gate(layout: MoELayout, base: SourceModel, layer: int, dtype) -> list[Job]:
    if layout.shared_expert_gate is None:  # GraniteMoeShared: added ungated
        return []
    hidden = base.config["hidden_size"]
    return [Job(layout.shared_expert_gate.format(layer=layer), (1, hidden), dtype, "random",
                "ffn", layer, std=GATE_SCALE / math.sqrt(hidden))]


def shared_expert_width(recipe: MoERecipe, base: SourceModel) -> int:
    """config.json's shared_expert_intermediate_size."""
    return 1 if recipe.shared_expert == "none" else base.config["intermediate_size"]


def downstream_notes(recipe: MoERecipe, layout: MoELayout, num_experts: int) -> list[str]:
    """What a reader of this output should know: llama.cpp's qwen2moe graph skips the top-k
    renormalisation that config.json's norm_topk_prob: true asks of transformers (when k < N;
    with k = N the softmax already sums to 1)."""
    if layout.llama_cpp_renormalises_topk or recipe.experts_per_token >= num_experts:
        return []
    return [
        f"{layout.model_type}: llama.cpp's {layout.model_type.replace('_', '')} graph does not "
        "renormalise the top-k router weights, but this config has norm_topk_prob: true (which "
        f"transformers applies, and which keeps the identical-experts parity); with "
        f"experts_per_token {recipe.experts_per_token} < {num_experts} experts, llama.cpp (GGUF) "
        "computes a different model than transformers. Use experts_per_token: "
        f"{num_experts} for outputs that must agree in llama.cpp (docs/recipes.md)."
    ]
