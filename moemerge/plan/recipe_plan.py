"""The plan of any recipe: its models opened (headers only) and its kind's planner
(recipe/kinds.py) run over them. What `build` runs, and what `moemerge extend` re-plans when it
merges the shared tensors again."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from moemerge.errors import RecipeError
from moemerge.io.adapter import AdapterReader
from moemerge.plan.common import check_expert_form
from moemerge.plan.jobs import Plan
from moemerge.plan.sources import SourceModel, check_assembly, check_moe_inputs, open_sources
from moemerge.recipe.base import PROMPTED
from moemerge.recipe.kinds import Kind, kind_of, labelled_refs
from moemerge.recipe.load import AnyRecipe


def open_and_plan(recipe: AnyRecipe, recipe_dir: Path | None, *, allow_pickle: bool,
                  stack: ExitStack) -> tuple[list[SourceModel], Plan]:
    """(the recipe's models, open until `stack` closes; its plan)."""
    models = open_sources(labelled_refs(recipe), recipe_dir, allow_pickle=allow_pickle,
                          stack=stack, compatible=kind_of(recipe).uniform,
                          vocabularies=not getattr(recipe, "merges_vocabularies", False))
    return models, make_plan(recipe, models)


def make_plan(recipe: AnyRecipe, models: list[SourceModel]) -> Plan:
    kind = kind_of(recipe)
    check_moe_inputs(kind.name, kind.takes_moes, models)
    if hasattr(recipe, "assembly"):
        check_assembly(recipe.assembly, models)
    check_adapters_read(recipe, kind, models)
    plan = kind.load("planner")(recipe, models)
    check_expert_form(recipe.output, plan.config)
    _made_by_readers(plan, models)
    return plan


def check_adapters_read(recipe: AnyRecipe, kind: Kind, models: list[SourceModel]) -> None:
    """A model with a LoRA adapter is applied where its tensors are read; the prompt inits of
    token routers run the base from its directory, which would leave its adapter out. Refused,
    with what works instead. (Calibration runs each input with its adapter written in:
    routing/calibration.source_as_stored.)"""
    adapted = [m.label for m in models if isinstance(m.reader, AdapterReader)]
    init = getattr(getattr(recipe, "router", None), "init", None)
    if not adapted or init is None:
        return
    if (init in PROMPTED and kind.router == "routing.routers:TokenRouters"
            and getattr(recipe, "base_model", None) is not None and models[0].label in adapted):
        raise RecipeError(f"router.init: {init} runs the base model from its directory, "
                          "without its LoRA adapter; write the base with its adapter first "
                          "(kind: merge of it alone), or use router.init: calibrate (with "
                          "named texts) or task_vector")


def _made_by_readers(plan: Plan, models: list[SourceModel]) -> None:
    """What the readers make of the tensors the jobs read (a LoRA adapter on a model: each
    targeted tensor is W + s·B·A, io/adapter.py), for --dry-run and the memory estimate; the
    models' notes join the plan's."""
    for job in plan.jobs:
        for source in job.inputs:
            if not getattr(source.change, "reads_stored", True):
                continue  # (a LoRA factor: plan/lora_experts.py)
            reader = models[source.model].reader
            describe = getattr(reader, "describe", None)
            what = describe(source.tensor) if describe is not None else None
            if what is not None:
                plan.made[source.model, source.tensor] = what
                plan.making_bytes = max(plan.making_bytes,
                                        reader.working_bytes(source.tensor))
    plan.notes += [note for model in models for note in model.notes]
