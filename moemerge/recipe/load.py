"""Read a recipe file; report every error at once, each naming the file and the field.

YAML is read with a budget: at most MAX_YAML_BYTES bytes and MAX_YAML_NODES nodes, counted
before the document is built (moemerge/bounds.py); aliases may add at most ALIAS_BUDGET nodes
to the document (a 436-byte "billion laughs" recipe otherwise expands to gigabytes once
validated and printed); a key given twice in one mapping is an error, not the last one kept;
and no message echoes more than a short prefix of a value.
"""

from __future__ import annotations

import functools
import re
import typing
from pathlib import Path
from typing import Annotated, Union

import yaml
from pydantic import BaseModel, Discriminator, Tag, TypeAdapter, ValidationError

from moemerge.bounds import MAX_STAGES, MAX_YAML_BYTES, MAX_YAML_NODES
from moemerge.errors import RecipeError
from moemerge.recipe.diagnose import at, did_you_mean, one_per_mistake, positions
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


def recipe_errors(data: object, text: str | None = None) -> list[str]:
    """Every problem with already-parsed recipe data, one 'field: message' line per mistake;
    with the recipe's `text`, each line starts with the line and column of the field."""
    if not isinstance(data, dict):
        what = "nothing" if data is None else f"a {type(data).__name__} ({short(data, 40)})"
        return [f"a recipe is a mapping of fields (kind: merge or moe, models or experts, ...); "
                f"this one holds {what}"]
    try:
        _ADAPTER.validate_python(data)
    except ValidationError as exc:
        errors = [{**e, "loc": e["loc"][1:] if e["loc"] and e["loc"][0] in _TAGS else e["loc"]}
                  for e in exc.errors()]
        where = positions(text) if text is not None else {}
        found = one_per_mistake(errors, data, _describe)
        found.sort(key=lambda item: where.get(item[0], (1 << 30, 0)))  # in the file's order
        return [at(path, where, message) for path, message in found]
    return []


@functools.cache
def _field_names() -> list[str]:
    """Every key a recipe may hold somewhere (fields and aliases of every block)."""
    names, queue, seen = set(), [kind.recipe for kind in KINDS], set()
    while queue:
        model = queue.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, info in model.model_fields.items():
            names.add(info.alias or name)
            queue += _models_in(info.annotation)
    return sorted(names)


def _models_in(annotation) -> list[type]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _models_in(a)]


ALIAS_BUDGET = 10_000  # nodes that aliases may add to a document
MAX_ERRORS_SHOWN = 20


def short(value: object, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters: user values in messages stay bounded."""
    text = repr(value)  # bounded: the alias budget keeps recipe values small
    return text if len(text) <= limit else text[:limit] + "…"


def safe_yaml(text: str, source: str, *, documents: bool = False) -> object:
    """yaml.safe_load with the alias budget and a clean error for anything malformed; with
    `documents`, the list of every document (a mergekit-multi config), each within the budget."""
    if len(text) > MAX_YAML_BYTES:
        raise RecipeError(f"{source}: {len(text):,} characters; a recipe or config is at most "
                          f"{MAX_YAML_BYTES:,} bytes")
    _count_nodes(text, source, documents)
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


# libyaml's parser where PyYAML has it: ~1 µs an event, against ~15 for PyYAML's own
_COUNTING_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _count_nodes(text: str, source: str, documents: bool) -> None:
    """Before anything is built: at most MAX_YAML_NODES nodes (scalars, lists and mappings of
    every document together) and, for a config of several documents, MAX_STAGES documents,
    counted from the parser's events and stopped at the bound (a million experts are refused
    in a tenth of a second, not parsed in half a minute). Malformed YAML is left to the parse
    proper, which names the line."""
    loader = _COUNTING_LOADER(text)
    nodes = docs = 0
    try:
        while loader.check_event():
            event = loader.get_event()
            if isinstance(event, yaml.ScalarEvent | yaml.CollectionStartEvent):
                nodes += 1
                if nodes > MAX_YAML_NODES:
                    raise RecipeError(f"{source}: more than {MAX_YAML_NODES:,} YAML nodes (values, "
                                      "keys, lists, mappings); a recipe or config has at most "
                                      f"{MAX_YAML_NODES:,} (4096 experts take about 50,000)")
            elif isinstance(event, yaml.DocumentStartEvent) and documents:
                docs += 1
                if docs > MAX_STAGES:
                    raise RecipeError(f"{source}: more than {MAX_STAGES} YAML documents; a "
                                      f"mergekit-multi config has at most {MAX_STAGES} documents "
                                      "(each a stage, a whole model built in turn)")
    except (yaml.YAMLError, UnicodeError, ValueError):
        return
    finally:
        loader.dispose()


def _checked(loader: yaml.SafeLoader, node: yaml.Node, source: str) -> object:
    """One document's data, once its aliases and numbers are within bounds."""
    added = _alias_growth(node)
    if added > ALIAS_BUDGET:
        raise RecipeError(f"{source}: YAML aliases would expand the recipe by more than "
                          f"{ALIAS_BUDGET} nodes (a recursive or \"billion laughs\" alias); "
                          "refused")
    _check_nodes(node, source)
    return loader.construct_document(node)


MAX_INT_CHARS = 4000  # Python converts at most 4300 digits to an int (a bare ValueError)


MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *defaults`, which may repeat


def _check_nodes(root: yaml.Node, source: str) -> None:
    """Refuse, naming the key and the line, an integer too long for Python to convert (the
    loader would raise a ValueError naming nothing; no field takes one), and a key given twice
    in one mapping (the loader would keep the last one silently)."""
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
            keys: set[tuple[str, str]] = set()
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else "?"
                if isinstance(key, yaml.ScalarNode) and key.tag != MERGE_TAG:
                    if (key.tag, key.value) in keys:
                        raise RecipeError(f"{source}: line {key.start_mark.line + 1}: "
                                          f"{where or 'the document'}: the key {short(name)} "
                                          "is given twice; give it once")
                    keys.add((key.tag, key.value))
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


def _describe(err: dict, path: tuple = ()) -> str:
    field = ".".join(str(p) for p in path) if path else _field_path(err["loc"])
    if err["type"] == "extra_forbidden":
        key = err["loc"][-1] if err["loc"] else ""
        if key in _field_names():  # right word, wrong block (a merge input has no `name`)
            return f"{field}: unknown field here ({key!r} is a field of other blocks, not this one)"
        return (f"{field}: unknown field (misspelt, or not valid here)"
                f"{did_you_mean(key, _field_names())}")
    if err["type"] == "union_tag_invalid":
        data = err["input"]
        if data.get("kind") == "moe":
            given = data.get("assembly")
            return (f"assembly: must be one of {', '.join(ASSEMBLIES)}, got {short(given)}"
                    f"{did_you_mean(given, list(ASSEMBLIES))}")
        return (f"kind: must be {_or([repr(n) for n in _KIND_NAMES])}, got "
                f"{short(data.get('kind'))}{did_you_mean(data.get('kind'), _KIND_NAMES)}")
    if err["type"] == "union_tag_not_found":
        return "kind: missing; say " + _or([f"'kind: {name}' ({BY_TAG[name].summary})"
                                             for name in _KIND_NAMES])
    if err["type"] == "literal_error":
        choices = re.findall(r"'([^']*)'", str(err["ctx"]["expected"]))
        return (f"{field}: must be one of {', '.join(choices)}; got {short(err['input'])}"
                f"{did_you_mean(err['input'], choices)}")
    msg = err["msg"].removeprefix("Value error, ")[:300]
    # whole-recipe checks name their own field at the start of the message
    return f"{field[:200]}: {msg}" if field else msg


def _or(items: list[str]) -> str:
    return ", ".join(items[:-1]) + " or " + items[-1]


def parse_recipe(data: object, source: str = "<recipe>", text: str | None = None) -> AnyRecipe:
    errors = recipe_errors(data, text)
    if errors:
        noun = "error" if len(errors) == 1 else "errors"
        lines = "\n".join(f"  - {e}" for e in errors[:MAX_ERRORS_SHOWN])
        if len(errors) > MAX_ERRORS_SHOWN:
            lines += f"\n  ... and {len(errors) - MAX_ERRORS_SHOWN} more"
        raise RecipeError(f"{source}: {len(errors)} recipe {noun}:\n{lines}")
    return _ADAPTER.validate_python(data)


def load_recipe_data(path: Path, *, documents: bool = False) -> object:
    return safe_yaml(read_recipe_text(path), str(path), documents=documents)


def read_recipe_text(path: Path) -> str:
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    try:
        if path.stat().st_size > MAX_YAML_BYTES:  # before it is read
            raise RecipeError(f"{path}: {path.stat().st_size:,} bytes; a recipe or config is "
                              f"at most {MAX_YAML_BYTES:,} bytes")
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{path}: not UTF-8 text (byte {exc.start}); a recipe is a YAML "
                          "text file") from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read the recipe: {exc.strerror}") from None
    return text


def load_recipe(path: Path) -> AnyRecipe:
    """Load and validate a recipe. Relative model paths are resolved against the recipe's dir."""
    path = Path(path)
    text = read_recipe_text(path)
    return parse_recipe(safe_yaml(text, str(path)), str(path), text)
