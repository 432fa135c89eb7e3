"""Read a recipe file; report every error at once, each naming the file and the field."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from moemerge.errors import RecipeError
from moemerge.recipe.models import MergeRecipe, MoERecipe, Recipe

_ADAPTER: TypeAdapter = TypeAdapter(Recipe)


def _field_path(loc: tuple) -> str:
    # pydantic puts the discriminator value ('moe'/'merge') first in a union's location
    if loc and loc[0] in ("moe", "merge"):
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
        return f"kind: must be 'merge' or 'moe', got {err['input'].get('kind')!r}"
    if err["type"] == "union_tag_not_found":
        return "kind: missing; say 'kind: merge' (dense merge) or 'kind: moe'"
    msg = err["msg"].removeprefix("Value error, ")
    # whole-recipe checks name their own field at the start of the message
    return f"{field}: {msg}" if field else msg


def parse_recipe(data: object, source: str = "<recipe>") -> MergeRecipe | MoERecipe:
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


def load_recipe(path: Path) -> MergeRecipe | MoERecipe:
    """Load and validate a recipe. Relative model paths are resolved against the recipe's dir."""
    path = Path(path)
    recipe = parse_recipe(load_recipe_data(path), str(path))
    return recipe
