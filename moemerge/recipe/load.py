"""Read a recipe file; report every error at once, each naming the file and the field."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import yaml
from pydantic import Discriminator, Tag, TypeAdapter, ValidationError

from moemerge.errors import RecipeError
from moemerge.recipe.merged import MergedExpertsRecipe
from moemerge.recipe.models import MergeRecipe, MoERecipe
from moemerge.recipe.sequence import BridgedRecipe, SeqRoutedRecipe

AnyRecipe = MergeRecipe | MoERecipe | SeqRoutedRecipe | BridgedRecipe | MergedExpertsRecipe
ASSEMBLIES = ("token_routed", "seq_routed", "bridged", "merged_experts")


def _recipe_tag(value) -> str | None:
    """'merge', 'moe' (token_routed, the default assembly) or 'moe:<assembly>'."""
    data = value if isinstance(value, dict) else vars(value)
    kind = data.get("kind")
    assembly = data.get("assembly", "token_routed")
    return kind if kind != "moe" or assembly == "token_routed" else f"moe:{assembly}"


Recipe = Annotated[
    Annotated[MergeRecipe, Tag("merge")] | Annotated[MoERecipe, Tag("moe")]
    | Annotated[SeqRoutedRecipe, Tag("moe:seq_routed")]
    | Annotated[BridgedRecipe, Tag("moe:bridged")]
    | Annotated[MergedExpertsRecipe, Tag("moe:merged_experts")],
    Discriminator(_recipe_tag),
]
_ADAPTER: TypeAdapter = TypeAdapter(Recipe)
_TAGS = ("merge", "moe", "moe:seq_routed", "moe:bridged", "moe:merged_experts")


def _field_path(loc: tuple) -> str:
    # pydantic puts the discriminator value ('moe', 'merge', ...) first in a union's location
    if loc and loc[0] in _TAGS:
        loc = loc[1:]
    return ".".join(str(p) for p in loc)


def recipe_errors(data: object) -> list[str]:
    """Every problem with already-parsed recipe data, as 'field: message' lines."""
    try:
        _ADAPTER.validate_python(data)
    except ValidationError as exc:
        return [_describe(err) for err in exc.errors()]
    return []


def _describe(err: dict) -> str:
    field = _field_path(err["loc"])
    if err["type"] == "extra_forbidden":
        return f"{field}: unknown field (misspelt, or not valid here)"
    if err["type"] == "union_tag_invalid":
        data = err["input"]
        if data.get("kind") == "moe":
            return (f"assembly: must be one of {', '.join(ASSEMBLIES)}, got "
                    f"{data.get('assembly')!r}")
        return f"kind: must be 'merge' or 'moe', got {data.get('kind')!r}"
    if err["type"] == "union_tag_not_found":
        return "kind: missing; say 'kind: merge' (dense merge) or 'kind: moe'"
    msg = err["msg"].removeprefix("Value error, ")
    # whole-recipe checks name their own field at the start of the message
    return f"{field}: {msg}" if field else msg


def parse_recipe(data: object, source: str = "<recipe>") -> AnyRecipe:
    errors = recipe_errors(data)
    if errors:
        noun = "error" if len(errors) == 1 else "errors"
        lines = "\n".join(f"  - {e}" for e in errors)
        raise RecipeError(f"{source}: {len(errors)} recipe {noun}:\n{lines}")
    return _ADAPTER.validate_python(data)


def load_recipe_data(path: Path) -> object:
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML: {exc}") from None


def load_recipe(path: Path) -> AnyRecipe:
    """Load and validate a recipe. Relative model paths are resolved against the recipe's dir."""
    path = Path(path)
    recipe = parse_recipe(load_recipe_data(path), str(path))
    return recipe
