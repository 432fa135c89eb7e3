"""A seq_routed MoE grown by new experts: each new expert's whole decoder stack joins as expert
E, E+1, ... as `build` writes an expert (plan/sequence.py's own jobs: `experts.{e}.model.*`,
and its own embedding and head with `per_expert`), `config.json` gets its dense config and
name, and `router.weight` [E, d_m] becomes [E + n, d_m].

The router: `build` writes a random one ((seed, name)-drawn, routing/init.random_router) for
every router kind, the placeholder that `router.init: calibrate` then overwrites; so does
extend, with the grown shape (the bytes a rebuild writes). A perplexity router reads nothing
else; a task_vector router reads the experts' stacks and the base's (`base.*`, copied), which
are all in place: nothing is stored per expert. A calibrated learned router is calibrated
again by the driver with `build`'s own calibration (routing.calibrate.calibrate_sequence_router).
"""

from __future__ import annotations

import torch

from moemerge.analysis.route import MAX_EXPERTS
from moemerge.architectures.config import dense_config
from moemerge.built.extend.recipe import REBUILD, depends_on_experts, loss_targets_error
from moemerge.built.extend.tensors import check_shapes
from moemerge.errors import MismatchError, RecipeError
from moemerge.execute import compute
from moemerge.io.reader import CheckpointReader
from moemerge.io.tensor_list import DenseTensor, config_dtype
from moemerge.plan.jobs import Job, Source
from moemerge.plan.sequence import PER_EXPERT, SHARED, body_jobs, role_tensor
from moemerge.plan.sources import SourceModel
from moemerge.recipe.sequence import SeqRoutedRecipe
from moemerge.routing.calibrate import Calibration, calibrate_sequence_router
from moemerge.routing.init import random_router

ROUTER = "router.weight"


def check_recipe(recipe, config: dict, moe) -> SeqRoutedRecipe:
    if not isinstance(recipe, SeqRoutedRecipe):
        raise RecipeError(f"{moe}: its recipe copy is not assembly: seq_routed, its config is")
    if recipe.router.kind == "learned" and recipe.router.init == "prompts":
        raise RecipeError(f"{moe}: its router was set from each expert's prompts (router.init: "
                          "prompts), which a new --expert has none of; add the expert with its "
                          "positive_prompts to the recipe and rebuild, or "
                          f"{REBUILD.removeprefix('rebuild it with ')} instead")
    if recipe.calibration is not None and recipe.calibration.targets == "loss":
        raise loss_targets_error(moe)
    return recipe


def changing(recipe: SeqRoutedRecipe) -> list[str]:
    """What a new expert would change among the shared tensors: the merged embedding and head,
    unless each expert keeps its own (per_expert)."""
    if set(SHARED) <= set(recipe.per_expert):
        return []
    return depends_on_experts(recipe)


def new_expert_jobs(recipe: SeqRoutedRecipe, config: dict, model: int, source: SourceModel,
                    index: int) -> list[Job]:
    """The jobs `plan_seq_routed` makes for an expert, for `source` (plan index `model`) as
    expert `index`."""
    dtype = config_dtype(config)
    jobs = [Job(PER_EXPERT[role].format(i=index), source.reader.meta(
                role_tensor(source, role)).shape, dtype, "copy", role, None,
                (Source(model, role_tensor(source, role)),))
            for role in ("embed", "lm_head") if role in recipe.per_expert]
    return jobs + body_jobs(model, source, f"experts.{index}.", dtype)


def check_expert(moe: CheckpointReader, config: dict, source: SourceModel, jobs: list[Job],
                 index: int, label: str) -> None:
    """The new expert's tensors, as expert `index`, are expert 0's, name for name and shape for
    shape, its embedding and head the shared ones' shape, and its family expert 0's."""
    family, want = source.config.get("model_type"), config["experts"][0].get("model_type")
    if family != want:
        raise MismatchError(f"{label}: a {family} model, the MoE's experts are {want}: not an "
                            "expert of this MoE's base (an expert must be fine-tuned from the "
                            "same base)")
    theirs = {n.removeprefix("experts.0."): tuple(moe.meta(n).shape) for n in moe.names()
              if n.startswith("experts.0.")}
    mine = {j.output.removeprefix(f"experts.{index}."): tuple(j.shape) for j in jobs}
    for role, shared in SHARED.items():
        if shared in moe.names():
            theirs[shared] = tuple(moe.meta(shared).shape)
            mine[shared] = tuple(source.reader.meta(role_tensor(source, role)).shape)
    check_shapes(mine, theirs, label, whose="the MoE's experts'")


def grown_config(config: dict, sources: list[SourceModel], names: list[str]) -> dict:
    """config.json with the new experts' dense configs and names appended, as
    architectures.config.sequence_config writes them."""
    count = len(config["experts"]) + len(sources)
    if count > MAX_EXPERTS:
        raise RecipeError(f"{count} experts: `moemerge route` reads at most {MAX_EXPERTS} "
                          "expert configs from a seq_routed config.json")
    dtype = config_dtype(config)
    return dict(config, experts=[*config["experts"],
                                 *(dense_config(s.config, dtype) for s in sources)],
                expert_names=[*config["expert_names"], *names])


def extended_tensors(moe: CheckpointReader, config: dict, recipe: SeqRoutedRecipe,
                     sources: list[SourceModel], jobs: list[Job]) -> list[DenseTensor]:
    """Every tensor of the MoE (the router grown, a rebuild's random draw), then the new
    experts' (`jobs`, made by build's executor from `sources`)."""
    count = len(config["experts"]) + len(sources)
    out = []
    for name in moe.names():
        meta = moe.meta(name)
        if name == ROUTER:
            shape = (count, *meta.shape[1:])
            out.append(DenseTensor(name, meta.dtype, shape, lambda s=shape, d=meta.dtype:
                                   random_router(s, router_std(recipe, config), recipe.seed,
                                                 ROUTER).to(d)))
        else:
            out.append(DenseTensor(name, meta.dtype, tuple(meta.shape),
                                   lambda n=name: moe.read(n)))

    def load(source: Source) -> torch.Tensor:
        return sources[source.model].reader.read(source.tensor)

    out += [DenseTensor(j.output, j.dtype, tuple(j.shape),
                        lambda j=j: compute(j, load, None, recipe.seed)) for j in jobs]
    return out


def router_std(recipe: SeqRoutedRecipe, config: dict) -> float:
    """build's: router.std, else the initializer_range of the model whose tokenizer it kept
    (the base when the recipe names one: kept whole in config.json with task_vector routing;
    otherwise the first expert's, which config.json carries)."""
    source = config.get("base") or config
    return recipe.router.std or source.get("initializer_range", 0.02)


def calibrated_routers(model, cal: Calibration) -> dict[str, torch.Tensor]:
    return {ROUTER: calibrate_sequence_router(model, cal)}
