"""The models a recipe reads, labelled, and the plan of any recipe kind: what `build` runs, and
what `moemerge extend` re-plans when it merges the shared tensors again."""

from __future__ import annotations

from pathlib import Path

from moemerge.plan.build import plan_merge, plan_token_routed
from moemerge.plan.jobs import Plan
from moemerge.plan.merged import plan_merged_experts
from moemerge.plan.sequence import plan_bridged, plan_seq_routed
from moemerge.plan.sources import SourceModel, check_assembly
from moemerge.plan.upcycle import plan_upcycle
from moemerge.recipe.load import AnyRecipe
from moemerge.recipe.merged import MergedExpertsRecipe
from moemerge.recipe.models import MergeRecipe
from moemerge.recipe.sequence import BridgedRecipe, SeqRoutedRecipe
from moemerge.recipe.shrink import ShrinkRecipe
from moemerge.recipe.upcycle import UpcycleRecipe


def labelled_refs(recipe: AnyRecipe) -> list[tuple[str, object]]:
    """(label, model reference) of every model the recipe reads, in plan order: the base, the
    reference, then the inputs or experts (a repeated label gets `#index`)."""
    refs = []
    if getattr(recipe, "base_model", None) is not None:
        refs.append(("base", recipe.base_model))
    if getattr(recipe, "reference", None) is not None:
        refs.append(("reference", recipe.reference))
    inputs = recipe.inputs if isinstance(recipe, MergeRecipe | UpcycleRecipe | ShrinkRecipe) \
        else recipe.experts
    for ref in inputs:
        label = getattr(ref, "name", None) or Path(ref.model.rstrip("/")).name
        taken = {lab for lab, _ in refs}
        refs.append((label if label not in taken else f"{label}#{len(refs)}", ref))
    return refs


def make_plan(recipe: AnyRecipe, models: list[SourceModel]) -> Plan:
    if hasattr(recipe, "assembly"):
        check_assembly(recipe.assembly, models)
    if isinstance(recipe, MergeRecipe):
        return plan_merge(recipe, models)
    if isinstance(recipe, SeqRoutedRecipe):
        return plan_seq_routed(recipe, models)
    if isinstance(recipe, BridgedRecipe):
        return plan_bridged(recipe, models)
    if isinstance(recipe, MergedExpertsRecipe):
        return plan_merged_experts(recipe, models)
    if isinstance(recipe, UpcycleRecipe):
        return plan_upcycle(recipe, models)
    return plan_token_routed(recipe, models)
