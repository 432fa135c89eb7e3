"""The shared tensors of an extended MoE merged again with the new experts, as `moemerge build` of
the output's recipe copy merges them.

The recipe copy (the old one, the new experts appended with their ordinary weight) is planned
with build's own planner (plan/recipe_plan.make_plan) on its models, read where the old copy
names them (a relative path next to MOE, else in the working directory). Every `merge` job of
that plan (alone, or inside a `fuse` job: Phi-3's qkv, Granite's shared MLP) reads the expert
set: its tensor is made by build's executor (execute.compute) and replaces MOE's copy. Every
other tensor (the experts' FFNs or stacks, copies of the base, random draws) is what MOE holds
or what the new experts bring, as without the re-merge.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from moemerge.built.extend.recipe import NewExpert, extended_recipe_text
from moemerge.errors import CheckpointError
from moemerge.execute import compute
from moemerge.io.atomic import RECIPE_COPY
from moemerge.io.tensor_list import DenseTensor
from moemerge.plan.jobs import Job, Source
from moemerge.plan.recipe_plan import make_plan
from moemerge.plan.sources import SourceModel, open_sources
from moemerge.recipe.kinds import labelled_refs
from moemerge.recipe.load import parse_recipe


@dataclass
class Remerge:
    models: list[SourceModel]  # the recipe copy's, plan order (the base first when named)
    base: SourceModel | None
    jobs: dict[str, Job]  # output name -> the merge that makes it
    seed: int

    def load(self, source: Source) -> torch.Tensor:
        tensor = self.models[source.model].reader.read(source.tensor)
        return tensor[slice(*source.rows)] if source.rows is not None else tensor

    def replace(self, tensors: list[DenseTensor]) -> list[DenseTensor]:
        """`tensors` with each re-merged one made by its job instead (same name and shape)."""
        out = []
        for t in tensors:
            job = self.jobs.get(t.name)
            if job is None:
                out.append(t)
                continue
            if tuple(job.shape) != tuple(t.shape):
                raise CheckpointError(f"tensor {t.name!r}: {tuple(t.shape)} in the MoE, "
                                      f"{tuple(job.shape)} in a rebuild of its recipe copy")
            out.append(DenseTensor(t.name, job.dtype, tuple(job.shape),
                                   lambda j=job: compute(j, self.load, None, self.seed)))
        return out


def merges(job: Job) -> bool:
    return job.operation == "merge" or any(merges(p) for group in job.parts for p in group)


def plan_remerge(data: dict, new: list[NewExpert], moe: Path, stack: ExitStack) -> Remerge:
    """The recipe copy `data` with the `new` experts appended (their ordinary weight): its
    models opened (headers) and planned; the merge jobs are kept."""
    text = extended_recipe_text(data, new, keep_shared=False)
    recipe = parse_recipe(yaml.safe_load(text), str(moe / RECIPE_COPY))
    try:
        models = open_sources(labelled_refs(recipe), moe, allow_pickle=False, stack=stack)
    except CheckpointError as exc:
        raise CheckpointError(
            f"{moe}: re-merging the shared tensors with the new experts reads the base and the "
            f"old experts where {RECIPE_COPY} names them: {exc}\n(--keep-shared keeps the shared "
            "tensors as built and reads none of them)") from None
    plan = make_plan(recipe, models)
    base = models[0] if getattr(recipe, "base_model", None) is not None else None
    return Remerge(models, base, {j.output: j for j in plan.jobs if merges(j)}, recipe.seed)
