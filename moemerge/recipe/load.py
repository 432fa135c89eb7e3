"""Read a recipe file; report every error at once, each naming the file and the field.

YAML is read with a budget: aliases may add at most ALIAS_BUDGET nodes to the document (a
436-byte "billion laughs" recipe otherwise expands to gigabytes once validated and printed),
and no message echoes more than a short prefix of a value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Union

import yaml
from pydantic import Discriminator, Tag, TypeAdapter, ValidationError

from moemerge.errors import RecipeError
from moemerge.recipe.kinds import ASSEMBLIES, BY_TAG, DEFAULT_ASSEMBLY, KINDS, AnyRecipe


def _recipe_tag(value) -> str | None:
    """'merge', 'moe' (the default assembly, token_routed) or 'moe:<assembly>'."""
    data = value if isinstance(value, dict) else vars(value)
    kind = data.get("kind")
    assembly = data.get("assembly", DEFAULT_ASSEMBLY)
    return kind if kind != "moe" or assembly == DEFAULT_ASSEMBLY else f"moe:{assembly}"


Recipe = Annotated[
    Union[tuple(Annotated[kind.recipe, Tag(kind.tag)] for kind in KINDS)],  # noqa: UP007 - made
    Discriminator(_recipe_tag),
]
_ADAPTER: TypeAdapter = TypeAdapter(Recipe)
_TAGS = tuple(BY_TAG)
_KIND_NAMES = list(dict.fromkeys(kind.tag.partition(":")[0] for kind in KINDS))


def _field_path(loc: tuple) -> str:
    # pydantic puts the discriminator value ('moe', 'merge', ...) first in a union's location
    if loc and loc[0] in _TAGS:
        loc = loc[1:]
    return ".".join(str(p) for p in loc)


def recipe_errors(data: object) -> list[str]:
    """Every problem with already-parsed recipe data, as 'field: message' lines."""
    if not isinstance(data, dict):
        what = "nothing" if data is None else f"a {type(data).__name__} ({short(data, 40)})"
        return [f"a recipe is a mapping of fields (kind: merge or moe, models or experts, ...); "
                f"this one holds {what}"]
    try:
        _ADAPTER.validate_python(data)
    except ValidationError as exc:
        return [_describe(err) for err in exc.errors()]
    return []


ALIAS_BUDGET = 10_000  # nodes that aliases may add to a document
MAX_ERRORS_SHOWN = 20


def short(value: object, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters: user values in messages stay bounded."""
    text = repr(value)  # bounded: the alias budget keeps recipe values small
    return text if len(text) <= limit else text[:limit] + "…"


def safe_yaml(text: str, source: str, *, documents: bool = False) -> object:
    """yaml.safe_load with the alias budget and a clean error for anything malformed; with
    `documents`, the list of every document (a mergekit-multi config), each within the budget."""
    loader = yaml.SafeLoader(text)
    try:
        if documents:
            found = []
            while loader.check_node():
                found.append(_checked(loader, loader.get_node(), source))
            return found
        node = loader.get_single_node()
        return None if node is None else _checked(loader, node, source)
    except yaml.YAMLError as exc:
        if isinstance(exc, yaml.composer.ComposerError) and "single document" in str(exc):
            line = exc.problem_mark.line + 1 if exc.problem_mark else "?"
            raise RecipeError(
                f"{source} holds several YAML documents (separated by '---' at line {line}); "
                "a recipe is one. A mergekit-multi config (several merges, later ones naming "
                "earlier outputs) becomes one `kind: stages` recipe with `moemerge "
                "import-mergekit`.") from None
        raise RecipeError(f"{source}: not valid YAML: {str(exc)[:500]}") from None
    except RecursionError:
        raise RecipeError(f"{source}: the YAML is nested too deeply") from None
    finally:
        loader.dispose()


def _checked(loader: yaml.SafeLoader, node: yaml.Node, source: str) -> object:
    """One document's data, once its aliases and numbers are within bounds."""
    added = _alias_growth(node)
    if added > ALIAS_BUDGET:
        raise RecipeError(f"{source}: YAML aliases would expand the recipe by more than "
                          f"{ALIAS_BUDGET} nodes (a recursive or \"billion laughs\" alias); "
                          "refused")
    _check_numbers(node, source)
    return loader.construct_document(node)


MAX_INT_CHARS = 4000  # Python converts at most 4300 digits to an int (a bare ValueError)


def _check_numbers(root: yaml.Node, source: str) -> None:
    """Refuse, naming the key and the line, an integer too long for Python to convert (the
    loader would raise a ValueError naming nothing); no field takes one."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    while stack:
        node, where = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            if node.tag.endswith(":int") and len(node.value) > MAX_INT_CHARS:
                raise RecipeError(f"{source}: line {node.start_mark.line + 1}: "
                                  f"{where or 'the document'}: an integer of {len(node.value)} "
                                  "digits; no field takes a number that large")
        elif isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else "?"
                stack.append((key, where))
                stack.append((value, f"{where}.{name}" if where else str(name)[:80]))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(node.value))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _alias_growth(root: yaml.Node) -> float:
    """How many nodes the document gains when every alias is expanded (inf for a cycle):
    expanded size minus distinct nodes, counted in linear time over the shared graph."""
    size: dict[int, float] = {}
    open_: set[int] = set()  # nodes whose children are still being counted: a cycle's path
    stack = [(root, False)]
    while stack:
        node, counted = stack.pop()
        if counted:
            open_.discard(id(node))
            size[id(node)] = 1 + sum(size[id(c)] for c in _children(node))
            if size[id(node)] - len(size) > ALIAS_BUDGET:
                return size[id(node)]  # stop early: no need to count a bomb to the end
            continue
        if id(node) in size:
            continue
        open_.add(id(node))
        stack.append((node, True))
        for child in _children(node):
            if id(child) in open_:
                return float("inf")
            if id(child) not in size:
                stack.append((child, False))
    return size[id(root)] - len(size)


def _describe(err: dict) -> str:
    field = _field_path(err["loc"])
    if err["type"] == "extra_forbidden":
        return f"{field}: unknown field (misspelt, or not valid here)"
    if err["type"] == "union_tag_invalid":
        data = err["input"]
        if data.get("kind") == "moe":
            return (f"assembly: must be one of {', '.join(ASSEMBLIES)}, got "
                    f"{short(data.get('assembly'))}")
        return f"kind: must be {_or([repr(n) for n in _KIND_NAMES])}, got {short(data.get('kind'))}"
    if err["type"] == "union_tag_not_found":
        return "kind: missing; say " + _or([f"'kind: {name}' ({BY_TAG[name].summary})"
                                             for name in _KIND_NAMES])
    msg = err["msg"].removeprefix("Value error, ")[:300]
    # whole-recipe checks name their own field at the start of the message
    return f"{field[:200]}: {msg}" if field else msg


def _or(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " or " + items[-1]


def parse_recipe(data: object, source: str = "<recipe>") -> AnyRecipe:
    errors = recipe_errors(data)
    if errors:
        noun = "error" if len(errors) == 1 else "errors"
        lines = "\n".join(f"  - {e}" for e in errors[:MAX_ERRORS_SHOWN])
        if len(errors) > MAX_ERRORS_SHOWN:
            lines += f"\n  ... and {len(errors) - MAX_ERRORS_SHOWN} more"
        raise RecipeError(f"{source}: {len(errors)} recipe {noun}:\n{lines}")
    return _ADAPTER.validate_python(data)


def load_recipe_data(path: Path, *, documents: bool = False) -> object:
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{path}: not UTF-8 text (byte {exc.start}); a recipe is a YAML "
                          "text file") from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read the recipe: {exc.strerror}") from None
    return safe_yaml(text, str(path), documents=documents)


def load_recipe(path: Path) -> AnyRecipe:
    """Load and validate a recipe. Relative model paths are resolved against the recipe's dir."""
    path = Path(path)
    recipe = parse_recipe(load_recipe_data(path), str(path))
    return recipe
