"""The tuning stage of a build: an untuned draft written and loaded, the search over it, and
the recipe with the chosen values (the build then plans and writes that recipe)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import yaml

from moemerge.execute import Load
from moemerge.loading import load_causal_lm
from moemerge.plan.jobs import Plan
from moemerge.recipe.load import AnyRecipe, parse_recipe
from moemerge.tune.output import tuned_recipe_text
from moemerge.tune.search import Candidate, Progress, TuneOptions, TuneResult, search


def tune_recipe(draft: Path, write_draft: Callable[[Path], None], plan: Plan, load: Load,
                tokenizer, held_out: dict[str, str], opts: TuneOptions, *, seed: int,
                recipe_text: str, source: str,
                report: Callable[[Candidate, Progress], None] | None = None
                ) -> tuple[AnyRecipe, str, TuneResult]:
    """(tuned recipe, its text, every candidate and the choice): `write_draft(draft)` writes the
    untuned model, which is loaded, searched (tune/search.py) and removed."""
    draft.mkdir()
    write_draft(draft)
    model, _ = load_causal_lm(draft)
    result = search(model, tokenizer, held_out, plan, load, seed, opts, report=report)
    del model
    shutil.rmtree(draft)
    text = tuned_recipe_text(recipe_text, result, opts)
    return parse_recipe(yaml.safe_load(text), source), text, result
