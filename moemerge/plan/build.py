"""Plans of dense merges (`kind: merge`; `slices` in plan/slices.py) and token-routed MoEs
(`assembly: token_routed`): recipe + input headers -> Plan, before any tensor data is read
(the inputs' shapes were checked when they were opened, plan/sources.py)."""

from __future__ import annotations

from dataclasses import replace

from moemerge.architectures import MoELayout, moe_layouts
from moemerge.architectures.config import dense_config, moe_config
from moemerge.errors import MismatchError, RecipeError
from moemerge.plan.common import (
    expert_source,
    merge_job,
    output_dtype,
    stored_layout,
    write_order,
)
from moemerge.plan.fused import fuse_jobs, split_fused
from moemerge.plan.jobs import Job, Plan, Source
from moemerge.plan.shared_expert import (
    check_shared_expert,
    downstream_notes,
    shared_expert_jobs,
    shared_expert_width,
)
from moemerge.plan.slices import plan_slices
from moemerge.plan.sources import SourceModel
from moemerge.plan.tokens import output_vocabulary
from moemerge.recipe.models import MergeRecipe, MoERecipe


def plan_merge(recipe: MergeRecipe, models: list[SourceModel]) -> Plan:
    """Dense merge. models = [base?] + recipe.models, base first when the recipe names one."""
    if recipe.slices:
        return plan_slices(recipe, models)
    has_base = recipe.base_model is not None
    base = 0 if has_base else None
    merged = list(range(int(has_base), len(models)))
    ref = models[0]
    dtype = output_dtype(recipe.output.dtype, ref)
    jobs = [
        split_fused(merge_job(name, ref.roles[name].role, ref.roles[name].layer,
                              ref.reader.meta(name).shape, dtype, recipe.merge, merged,
                              recipe.models,
                              base, num_layers=ref.config.get("num_hidden_layers")),
                    ref.roles[name], ref.config)  # Phi-3: q, k, v (gate, up) merged apart
        for name in write_order(ref.roles)
    ]
    config = dense_config(ref.config, dtype)
    check_router_init(recipe, ref)
    if ref.family.layout is not None:  # MoEs merged expert by expert, stored as asked
        layout = moe_layouts()[ref.family.layout]
        jobs = fuse_jobs(stored_layout(layout, recipe.output), jobs)
        config.update({k: v for k, v in layout.config.items() if k == "auto_map"})
    if recipe.tokenizer is None:
        return Plan([m.label for m in models], jobs, config)
    tokenizer, alignment = output_vocabulary(recipe, models)
    jobs = [replace(job, shape=(alignment.size, *job.shape[1:]), vocab=alignment,
                    context=tuple(Source(m, job.output) for m in range(len(models))))
            if job.role in ("embed", "lm_head") else job for job in jobs]
    config["vocab_size"] = alignment.size
    return Plan([m.label for m in models], jobs, config, tokenizer=tokenizer)


def check_router_init(recipe: MergeRecipe, ref: SourceModel) -> None:
    """router.init: calibrate needs MoE inputs whose routers softmax their logits (the fit
    is to the log of the inputs' routing: a shift shared by all logits is free)."""
    if recipe.router.init != "calibrate":
        return
    if ref.family.layout is None:
        raise RecipeError("router.init: calibrate: the inputs are dense models, which have no "
                          "routers; it is for merges of MoE fine-tunes")
    layout = moe_layouts()[ref.family.layout]
    if layout.router_scoring != "softmax":
        raise RecipeError(f"router.init: calibrate: {layout.name} scores experts with a "
                          f"{layout.router_scoring} and a per-expert bias, which the fit to "
                          "the inputs' softmax routing does not set; use router.init: merge")


def plan_token_routed(recipe: MoERecipe, models: list[SourceModel]) -> Plan:
    """Branch-Train-Mix. models = [base] + experts; each expert's FFN becomes an MoE expert in
    every layer (the base's own FFN last when include_base_expert), the other tensors are merged
    across the experts, and a router is added to every layer."""
    base = models[0]
    layout = stored_layout(base.family.moe_layout(base.where(), recipe.shared_expert != "none",
                                                  recipe.layout), recipe.output)
    dtype = output_dtype(recipe.output.dtype, base)
    experts = list(range(1, 1 + len(recipe.experts)))  # (a shared expert's model comes last)
    ffn_owners = experts + ([0] if recipe.include_base_expert else [])
    hidden = base.config["hidden_size"]
    refuse_unsupported_tensors(base, layout)
    check_shared_expert(recipe, layout)

    jobs: list[Job] = []
    layers_done: set[int] = set()
    for name in write_order(base.roles):
        role = base.roles[name]
        shape = base.reader.meta(name).shape
        if role.role != "ffn":
            jobs.append(merge_job(name, role.role, role.layer, shape, dtype, recipe.merge, experts,
                                  recipe.experts, 0,
                                  num_layers=base.config.get("num_hidden_layers")))
            continue
        layer = role.layer
        if layer not in layers_done:  # the router and the shared expert, once per layer
            layers_done.add(layer)
            gates = [n for n, r in base.roles.items() if r.layer == layer and r.proj == "gate"]
            reads = recipe.router.init == "task_vector"  # the other inits read no tensor
            jobs.append(Job(
                layout.router_name(layer), (len(ffn_owners), hidden), dtype, "router", "router",
                layer, sources=tuple(Source(m, gates[0]) for m in ffn_owners) if reads else (),
                base=Source(0, gates[0]) if reads else None, router_init=recipe.router.init,
            ))
            jobs += shared_expert_jobs(recipe, layout, models, layer, dtype, experts)
            jobs += zero_biases(layout, base, layer, dtype)
        for index, owner in enumerate(ffn_owners):
            output = layout.expert_name(layer, index, role.proj)
            ref = recipe.experts[owner - 1] if owner else None  # (the base's FFN: as it is)
            jobs.append(Job(output, shape, dtype, "copy", "ffn", layer,
                            (expert_source(owner, name, role.proj, ref, recipe.seed, output),)))
    config = moe_config(
        base.config, layout, dtype, num_experts=len(ffn_owners),
        experts_per_token=recipe.top_k,
        shared_width=shared_expert_width(recipe, base),
    )
    return Plan([m.label for m in models], fuse_jobs(layout, jobs), config,
                notes=downstream_notes(layout, recipe.top_k, len(ffn_owners),
                                       shared=recipe.shared_expert != "none"))


def zero_biases(layout: MoELayout, base: SourceModel, layer: int, dtype) -> list[Job]:
    """The attention biases the layout has and the source lacks, as zeros (Llama → Qwen2-MoE:
    a zero bias adds nothing)."""
    jobs = []
    for module in layout.zero_biases:
        name = f"model.layers.{layer}.{module}"
        if f"{name}.bias" not in base.roles:
            rows = base.reader.meta(f"{name}.weight").shape[0]
            jobs.append(Job(f"{name}.bias", (rows,), dtype, "zeros", "attn", layer))
    return jobs


def refuse_unsupported_tensors(base: SourceModel, layout: MoELayout) -> None:
    held = tuple(f".{module}.bias" for module in layout.zero_biases)
    unheld = [n for n in base.roles if n.endswith(".bias") and not n.endswith(held)]
    if held and unheld:
        raise MismatchError(
            f"{base.where()} has bias tensors that {layout.architecture} does not hold (e.g. "
            f"{unheld[0]!r}; it has biases only in {', '.join(layout.zero_biases)}), so it "
            "cannot become one without losing them")
    if not layout.holds_biases:
        biased = [n for n in base.roles if n.endswith(".bias")]
        if biased:
            raise MismatchError(
                f"{base.where()} has bias tensors (e.g. {biased[0]!r}) but {layout.architecture} "
                "has no biases; a source with attention or MLP biases cannot become one without "
                "losing them. Qwen2 sources (biased attention) go to Qwen2-MoE instead."
            )
