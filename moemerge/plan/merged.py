"""Plan of the merged-experts kind: the base's dense backbone with non-FFN tensors merged across
the experts, and in every layer a reference FFN E_m, the experts' FFNs, a router and the
curvature factors (identity). Same jobs, same executor as every other kind."""

from __future__ import annotations

import torch

from moemerge.architectures.config import merged_config
from moemerge.errors import MismatchError
from moemerge.modeling.curvature_moemerge import split_dim
from moemerge.plan.common import merge_job, output_dtype, write_order
from moemerge.plan.fused import fused_parts, split_fused
from moemerge.plan.jobs import Job, Plan, Source
from moemerge.plan.sources import SourceModel
from moemerge.recipe.merged import MergedExpertsRecipe

PROJ_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def plan_merged_experts(recipe: MergedExpertsRecipe, models: list[SourceModel]) -> Plan:
    """models = [base, reference?] + experts."""
    base = models[0]
    reference = 1 if recipe.reference is not None else 0
    experts = list(range(1 + int(recipe.reference is not None), len(models)))
    dtype = output_dtype(recipe.output.dtype, base)
    hidden = base.config["hidden_size"]
    std = recipe.router.std or base.config.get("initializer_range", 0.02)
    jobs: list[Job] = []
    for name in write_order(base.roles):
        role = base.roles[name]
        shape = base.reader.meta(name).shape
        if role.role != "ffn":
            jobs.append(split_fused(merge_job(name, role.role, role.layer, shape, dtype,
                                              recipe.merge, experts, recipe.experts, 0,
                                              num_layers=base.config.get("num_hidden_layers")),
                                    role, base.config))
            continue
        if name.endswith(".bias"):
            raise MismatchError(f"{base.where()} has FFN bias {name!r}; merged_experts merges "
                                "FFN weight matrices only")
        for part, rows in (fused_parts(role, base.config) or {role.proj: None}).items():
            jobs += _ffn_jobs(recipe, name, part, rows, shape, dtype, reference, experts, hidden,
                              std, role.layer)
    if not any(r.role == "lm_head" for r in base.roles.values()):
        # a tied source stores no head; this model's head is its own tensor (untied)
        embed = next(n for n, r in base.roles.items() if r.role == "embed")
        jobs.append(merge_job(embed, "lm_head", None, base.reader.meta(embed).shape, dtype,
                              recipe.merge, experts, recipe.experts, 0,
                              output="lm_head.weight"))
    config = merged_config(
        base.config, [models[m].label for m in experts], dtype=dtype,
        segment_length=recipe.segment_length, alpha=recipe.alpha,
        curvature=recipe.curvature.kind, curvature_rank=recipe.curvature.rank,
        mask=recipe.mask.kind, dare_p=recipe.mask.p, dynamic=recipe.dynamic)
    return Plan([m.label for m in models], jobs, config)


def _ffn_jobs(recipe: MergedExpertsRecipe, name: str, part: str, rows: tuple[int, int] | None,
              shape, dtype, reference: int, experts: list[int], hidden: int, std: float,
              layer: int) -> list[Job]:
    """One projection `part` (gate / up / down) of one layer: E_m, the experts' copies, the
    router (with the gate) and the curvature. `rows`: the part's rows of a fused tensor."""
    proj, mlp = PROJ_NAMES[part], f"model.layers.{layer}.mlp"
    shape = (rows[1] - rows[0], *shape[1:]) if rows is not None else shape
    jobs = []
    if not recipe.dynamic or layer == 0:
        jobs.append(Job(f"{mlp}.reference.{proj}.weight", shape, dtype, "copy", "ffn", layer,
                        (Source(reference, name, rows),)))
    jobs += [Job(f"{mlp}.experts.{i}.{proj}.weight", shape, dtype, "copy", "ffn", layer,
                 (Source(m, name, rows),)) for i, m in enumerate(experts)]
    if part == "gate":  # once per layer
        jobs.append(Job(f"{mlp}.router.weight", (len(experts), hidden), dtype, "random",
                        "router", layer, router_init=recipe.router.init, std=std))
    if recipe.curvature.kind == "kronecker":
        jobs += _curvature_jobs(f"{mlp}.curvature.{proj}", shape, len(experts),
                                recipe.curvature.rank, layer)
    return jobs


def _curvature_jobs(prefix: str, shape, n: int, rank: int, layer: int) -> list[Job]:
    """A, B [N, R, o, o] and C, D [N, R, i, i]: identity factors, so M_i = I at the start.
    Curvature is trained in fp32 whatever the output dtype."""
    (o1, o2), (i1, i2) = split_dim(shape[0]), split_dim(shape[1])
    return [Job(f"{prefix}.{factor}", (n, rank, d, d), torch.float32, "identity", "curvature",
                layer) for factor, d in zip("ABCD", (o1, o2, i1, i2), strict=True)]
