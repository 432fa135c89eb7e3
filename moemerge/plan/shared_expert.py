"""The always-on shared expert of token-routed layouts that have one (Qwen2-MoE,
DeepSeek-MoE, GraniteMoeShared).

Qwen2-MoE's FFN is  routed(x) + sigmoid(g . x) * shared(x),  with g = shared_expert_gate [1, H]
and x the post-attention-normed hidden state. The recipe's `shared_expert` picks `shared`:

  none     zeros of width 1: adds nothing, so identical experts still give the dense logits
           (DeepSeek-MoE: no shared expert at all, n_shared_experts null).
  base     the base model's FFN; average  the experts' FFN average (weighted like the experts);
  {model: ...}  that model's FFN (mergekit-moe's `shared_experts`; the model is the plan's last).

g starts as N(0, std²) with std = GATE_SCALE / sqrt(H): g . x ~ N(0, (GATE_SCALE · rms(x))²),
so sigmoid(g . x) ≈ 0.5 for every token and the gate is free to move either way when trained.
The gate has no bias, so no row makes sigmoid(g . x) small for every x; ≈ 0.5 is the neutral
start, and with `base` the FFN begins as  routed(x) + ½ FFN_base(x)  (docs/recipes.md). g is
never all zeros: llama.cpp evaluates this sigmoid as silu(z) / z, which is 0 / 0 = NaN at z = 0.

Under mergekit-moe's prompt inits (`router.init: mergekit_*`) a shared model with
positive_prompts gets mergekit's gate instead: its prompts' row, computed with the experts'
(routing/routers.py).

DeepSeek-MoE and GraniteMoeShared add their shared MLP with no gate: routed(x) + shared(x).
Granite sources with `shared_expert: none` become a GraniteMoE (no shared MLP at all) instead.
"""

from __future__ import annotations

import math

from moemerge.architectures.tables import MoELayout
from moemerge.errors import RecipeError
from moemerge.plan.common import expert_source, merge_job
from moemerge.plan.jobs import Job
from moemerge.plan.sources import SourceModel
from moemerge.recipe.base import MERGEKIT_INITS
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


def shared_expert_jobs(recipe: MoERecipe, layout: MoELayout, models: list[SourceModel],
                       layer: int, dtype, experts: list[int]) -> list[Job]:
    """The shared expert's projections and its gate in `layer` (none if the layout has none).
    models: the plan's, the base first and a shared expert's model last."""
    base = models[0]
    if layout.shared_expert is None:
        return []
    if recipe.shared_expert == "none":
        return zeroed_shared_expert(layout, base, layer, dtype)
    owner = len(models) - 1 if recipe.shared_model is not None else 0
    jobs = []
    for proj, name in _ffn(base, layer):
        output = layout.shared_name(layer, proj)
        shape = base.reader.meta(name).shape
        if recipe.shared_expert == "average":  # the experts' FFN average, with their weights
            jobs.append(merge_job(name, "ffn", layer, shape, dtype, MergeSpec(), experts,
                                  recipe.experts, None, output=output))
        else:  # the base's FFN, or the shared model's (with its noise and residual scale)
            source = expert_source(owner, name, proj, recipe.shared_model, recipe.seed, output)
            jobs.append(Job(output, shape, dtype, "copy", "ffn", layer, (source,)))
    return [*jobs, *_gate(layout, base, layer, dtype, recipe)]


def zeroed_shared_expert(layout: MoELayout, base: SourceModel, layer: int,
                         dtype) -> list[Job]:
    """A shared expert of width 1 and all zeros (its output is 0, so the logits are the routed
    experts' alone) behind a gate that is never exactly zero (llama.cpp); none if the layout has
    no shared expert or may leave it out (DeepSeek-MoE)."""
    if layout.shared_expert is None or layout.shared_count_key is not None:
        return []
    hidden = base.config["hidden_size"]
    jobs = [Job(layout.shared_name(layer, proj), (hidden, 1) if proj == "down" else (1, hidden),
                dtype, "zeros", "ffn", layer) for proj, _ in _ffn(base, layer)]
    return [*jobs, *_gate(layout, base, layer, dtype)]


def _ffn(base: SourceModel, layer: int) -> list[tuple[str, str]]:
    """(projection, tensor name) of the base's FFN in `layer`."""
    return sorted((r.proj, n) for n, r in base.roles.items()
                  if r.layer == layer and r.role == "ffn")


def _gate(layout: MoELayout, base: SourceModel, layer: int, dtype,
          recipe: MoERecipe | None = None) -> list[Job]:
    """The shared expert's gate [1, H]: mergekit's row of the shared model's prompts (role
    `shared_gate`, made by the router maker), else near 0 (sigmoid ≈ 0.5)."""
    if layout.shared_expert_gate is None:  # DeepSeek-MoE, GraniteMoeShared: added ungated
        return []
    hidden = base.config["hidden_size"]
    name = layout.shared_expert_gate.format(layer=layer)
    if recipe is not None and shared_gate_from_prompts(recipe):
        return [Job(name, (1, hidden), dtype, "router", "shared_gate", layer,
                    router_init=recipe.router.init)]
    return [Job(name, (1, hidden), dtype, "random", "ffn", layer,
                std=GATE_SCALE / math.sqrt(hidden))]


def shared_gate_from_prompts(recipe: MoERecipe) -> bool:
    """True when the shared expert's gate is mergekit-moe's, from its model's prompts."""
    shared = recipe.shared_model
    return shared is not None and bool(shared.positive_prompts) and \
        recipe.router.init in MERGEKIT_INITS


def shared_expert_width(recipe: MoERecipe, base: SourceModel) -> int | None:
    """The shared expert's FFN width (config.json's shared_expert_intermediate_size, or
    n_shared_experts in expert widths), None without one."""
    return None if recipe.shared_expert == "none" else base.config["intermediate_size"]


def downstream_notes(layout: MoELayout, k: int, num_experts: int, shared: bool) -> list[str]:
    """What a reader of this output should know: llama.cpp's qwen2moe and deepseek graphs skip
    the top-k renormalisation that config.json's norm_topk_prob: true asks of transformers
    (when k < N; with k = N the softmax already sums to 1); DeepSeek's own code skips it for
    k = 1."""
    if not layout.renormalises_top1 and k == 1:
        return [f"{layout.model_type}: with experts_per_token 1 each token's expert output is "
                "scaled by its softmax routing weight (the top-k renormalisation applies for "
                "k > 1 only), so identical experts do not give the dense model; llama.cpp "
                "computes the same"]
    if layout.llama_cpp_renormalises_topk or k >= num_experts:
        return []
    return [
        f"{layout.model_type}: llama.cpp's {layout.model_type.replace('_', '')} graph does not "
        "renormalise the top-k router weights, but this config has norm_topk_prob: true (which "
        "transformers applies" + (", and which keeps the identical-experts parity"
                                  if not shared else "") + "); with "
        f"top-{k} of {num_experts} experts, llama.cpp (GGUF) computes a different model than "
        f"transformers. Route every token to all {num_experts} experts for outputs that must "
        "agree in llama.cpp (docs/recipes.md)."
    ]
