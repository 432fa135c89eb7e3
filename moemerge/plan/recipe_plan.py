"""The plan of any recipe: its models opened (headers only) and its kind's planner
(recipe/kinds.py) run over them. What `build` runs, and what `moemerge extend` re-plans when it
merges the shared tensors again."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from moemerge.plan.common import check_expert_form
from moemerge.plan.jobs import Plan
from moemerge.plan.sources import SourceModel, check_assembly, check_moe_inputs, open_sources
from moemerge.recipe.kinds import kind_of, labelled_refs
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
    plan = kind.load("planner")(recipe, models)
    check_expert_form(recipe.output, plan.config)
    return plan
