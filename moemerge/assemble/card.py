"""The model card (README.md) written next to a built checkpoint."""

from __future__ import annotations

import yaml

from moemerge import __version__
from moemerge.plan.jobs import Plan
from moemerge.recipe.models import MergeRecipe, MoERecipe


def model_card(recipe: MergeRecipe | MoERecipe, plan: Plan, recipe_text: str) -> str:
    if isinstance(recipe, MoERecipe):
        bases = [recipe.base_model.model, *(e.model for e in recipe.experts)]
        experts = [(e.name or "", e.model) for e in recipe.experts]
        if recipe.include_base_expert:
            experts.append(("base", recipe.base_model.model))
        what = (
            f"a token-routed Mixture-of-Experts ({plan.config['architectures'][0]}) with "
            f"{len(experts)} experts, {recipe.experts_per_token} per token, built from dense "
            f"experts branched from `{recipe.base_model.model}`"
        )
        details = [
            "| expert | name | FFN from |", "|---|---|---|",
            *(f"| {i} | {name} | `{model}` |" for i, (name, model) in enumerate(experts)),
            "",
            f"Non-FFN tensors merged with `{recipe.merge.method}`; router init "
            f"`{recipe.router.init}`.",
        ]
    else:
        refs = ([recipe.base_model] if recipe.base_model else []) + recipe.models
        bases = [m.model for m in refs]
        what = f"a dense `{recipe.merge.method}` merge of {len(recipe.models)} models"
        details = ["| model | weight |", "|---|---|",
                   *(f"| {m.model} | {m.weight:g} |" for m in recipe.models)]
    front = yaml.safe_dump(
        {"base_model": list(dict.fromkeys(bases)), "library_name": "transformers",
         "tags": ["moemerge", "merge", *(["moe"] if isinstance(recipe, MoERecipe) else [])]},
        sort_keys=False,
    )
    size = sum(j.nbytes for j in plan.jobs) / 2**20
    return "\n".join([
        "---", front.rstrip(), "---", "",
        f"# {recipe.name or 'moemerge model'}", "",
        f"This model is {what}. Made with moemerge {__version__}.", "",
        *details, "",
        f"{len(plan.jobs)} tensors, {size:,.1f} MiB.", "",
        "## Recipe", "", "```yaml", recipe_text.rstrip(), "```", "",
    ])
