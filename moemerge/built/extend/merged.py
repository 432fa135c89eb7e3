"""A merged_experts MoE (SMEAR / Lory / CAMEx) grown by new experts: in every layer each new
expert's FFN weights join the layer's expert stack as `mlp.experts.{e}.{gate,up,down}_proj`
(read as plan/merged.py reads an expert's: a fused gate_up split by rows), `config.json`'s
`num_experts` and `expert_names` grow, and per layer:

- `mlp.router.weight` [E, H] becomes [E + n, H]: build's random draw of that shape and name
  (the router a rebuild writes, and the placeholder a calibrated one starts from, which the
  driver then calibrates again with build's own calibrate_merged_routers);
- `mlp.curvature.{proj}.{A,B,C,D}` [E, R, d, d] (CAMEx) get n more slots at the identity,
  what build writes for every expert (M_i = I): the old slots are copied.

The reference E_m, the old experts and the backbone are copied; the TIES-CA sign election and
a dynamic E_m's mean read every expert at run time, as in a rebuild.
"""

from __future__ import annotations

import torch

from moemerge.built.extend.recipe import depends_on_experts, loss_targets_error
from moemerge.built.extend.tensors import check_shapes
from moemerge.errors import MismatchError, RecipeError
from moemerge.execute import compute
from moemerge.io.reader import CheckpointReader
from moemerge.io.tensor_list import DenseTensor, config_dtype, write_order
from moemerge.plan.fused import fused_parts
from moemerge.plan.jobs import Job, Source
from moemerge.plan.merged import PROJ_NAMES
from moemerge.plan.sources import SourceModel
from moemerge.recipe.merged import MergedExpertsRecipe
from moemerge.routing.calibrate import Calibration, calibrate_merged_routers

MLP = "model.layers.{layer}.mlp"


def check_recipe(recipe, config: dict, moe) -> MergedExpertsRecipe:
    if not isinstance(recipe, MergedExpertsRecipe):
        raise RecipeError(f"{moe}: its recipe copy is not assembly: merged_experts, its config "
                          "is")
    settings = {"curvature": recipe.curvature.kind, "mask": recipe.mask.kind,
                "dynamic": recipe.dynamic}
    changed = [f"{k}: {config.get(k)!r}, the recipe copy's {v!r}" for k, v in settings.items()
               if config.get(k) != v]
    if changed:
        raise RecipeError(f"{moe}: changed since `moemerge build` wrote it ({'; '.join(changed)}"
                          ": exported?); extend the model build wrote")
    if recipe.calibration is not None and recipe.calibration.targets == "loss":
        raise loss_targets_error(moe)
    return recipe


def changing(recipe: MergedExpertsRecipe) -> list[str]:
    """The backbone's attention, norms, embedding and head are merged across the experts."""
    return depends_on_experts(recipe)


def new_expert_jobs(recipe: MergedExpertsRecipe, config: dict, model: int, source: SourceModel,
                    index: int) -> list[Job]:
    """Expert `index`'s FFN copies, as plan/merged.py's _ffn_jobs makes an expert's, from
    `source` (plan index `model`)."""
    dtype = config_dtype(config)
    jobs = []
    for name, role in source.roles.items():
        if role.role != "ffn":
            continue
        if name.endswith(".bias"):
            raise MismatchError(f"{source.where()} has FFN bias {name!r}; merged_experts "
                                "merges FFN weight matrices only")
        shape = tuple(source.reader.meta(name).shape)
        for part, rows in (fused_parts(role, source.config) or {role.proj: None}).items():
            part_shape = (rows[1] - rows[0], *shape[1:]) if rows is not None else shape
            jobs.append(Job(f"{MLP.format(layer=role.layer)}.experts.{index}."
                            f"{PROJ_NAMES[part]}.weight", part_shape, dtype, "copy", "ffn",
                            role.layer, (Source(model, name, rows),)))
    return jobs


def check_expert(moe: CheckpointReader, config: dict, source: SourceModel, jobs: list[Job],
                 index: int, label: str) -> None:
    """The new expert has the base's family, the backbone's non-FFN tensors (name and shape)
    and, in every layer, FFN weights of the experts' shapes."""
    family, want = source.config.get("model_type"), config["base"].get("model_type")
    if family != want:
        raise MismatchError(f"{label}: a {family} model, the MoE's base is {want}: not an "
                            "expert of this MoE's base (an expert must be fine-tuned from the "
                            "same base)")
    mine = {j.output.replace(f".experts.{index}.", ".experts.0."): tuple(j.shape) for j in jobs}
    present = set(moe.names())
    theirs = {n: tuple(moe.meta(n).shape) for n in present if ".mlp.experts.0." in n}
    for name, role in source.roles.items():
        if role.role != "ffn":
            mine[name] = tuple(source.reader.meta(name).shape)
            theirs[name] = tuple(moe.meta(name).shape) if name in present else None
    check_shapes(mine, theirs, label)


def grown_config(config: dict, sources: list[SourceModel], names: list[str]) -> dict:
    return dict(config, num_experts=config["num_experts"] + len(names),
                expert_names=[*config["expert_names"], *names])


def extended_tensors(moe: CheckpointReader, config: dict, recipe: MergedExpertsRecipe,
                     sources: list[SourceModel], jobs: list[Job]) -> list[DenseTensor]:
    """Every tensor of the grown MoE, embedding first, then layer by layer."""
    added, seed = len(sources), recipe.seed
    std = recipe.router.std or config["base"].get("initializer_range", 0.02)
    out = []
    for name in moe.names():
        meta = moe.meta(name)
        shape, dtype = tuple(meta.shape), meta.dtype
        if name.endswith(".mlp.router.weight"):  # build's random job, grown
            job = Job(name, (shape[0] + added, *shape[1:]), dtype, "random", "router",
                      None, std=std)
            out.append(DenseTensor(name, dtype, tuple(job.shape),
                                   lambda j=job: compute(j, _no_source, None, seed)))
        elif ".mlp.curvature." in name:  # [E, R, d, d]: n more slots at build's identity
            job = Job(name, (added, *shape[1:]), dtype, "identity", "curvature")

            def grow(name=name, job=job) -> torch.Tensor:
                return torch.cat([moe.read(name), compute(job, _no_source, None, seed)])

            out.append(DenseTensor(name, dtype, (shape[0] + added, *shape[1:]), grow))
        else:
            out.append(DenseTensor(name, dtype, shape, lambda n=name: moe.read(n)))

    def load(source: Source) -> torch.Tensor:
        tensor = sources[source.model].reader.read(source.tensor)
        return tensor[slice(*source.rows)] if source.rows is not None else tensor

    out += [DenseTensor(j.output, j.dtype, tuple(j.shape),
                        lambda j=j: compute(j, load, None, seed)) for j in jobs]
    return sorted(out, key=write_order)


def _no_source(source: Source) -> torch.Tensor:
    raise AssertionError(f"a random or identity job read {source}")


def calibrated_routers(model, cal: Calibration) -> dict[str, torch.Tensor]:
    return {f"{MLP.format(layer=layer)}.router.weight": router
            for layer, router in calibrate_merged_routers(model, cal).items()}
