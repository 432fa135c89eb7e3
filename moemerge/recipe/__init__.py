"""Recipes: what to build, validated strictly before anything is read."""

from moemerge.recipe.base import ExpertRef, ModelRef
from moemerge.recipe.load import load_recipe, parse_recipe, recipe_errors
from moemerge.recipe.merge import MergeSpec
from moemerge.recipe.models import MergeRecipe, MoERecipe

__all__ = [
    "ExpertRef", "MergeRecipe", "MergeSpec", "ModelRef", "MoERecipe",
    "load_recipe", "parse_recipe", "recipe_errors",
]
