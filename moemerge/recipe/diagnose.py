"""pydantic's errors as a recipe writer reads them: one message per mistake, at the field the
writer typed, with the line and column of the YAML where there is a text, and a "did you mean"
for a misspelt key or choice.

pydantic reports a bad value in a union field once per member (`merge.density.float`,
`merge.density.list[float]`): those are one mistake, at `merge.density`, and become one
message naming every shape the field takes.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable

import yaml

Path_ = tuple[str | int, ...]

SHAPES = {"float": "a number", "int": "a whole number", "bool": "true or false",
          "string": "a text", "list": "a list", "dict": "a mapping", "model": "a mapping",
          "tuple": "a list", "literal": "one of the listed values", "none": "null"}


def positions(text: str) -> dict[Path_, tuple[int, int]]:
    """{field path: (line, column)} of every key and list item of the YAML `text`, 1-based;
    {} where the text does not parse (its own error says where)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    found: dict[Path_, tuple[int, int]] = {}
    stack: list[tuple[yaml.Node, Path_]] = [(root, ())] if root is not None else []
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if id(node) in seen:  # an alias: counted once
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    here = (*path, key.value)
                    found.setdefault(here, (key.start_mark.line + 1, key.start_mark.column + 1))
                    stack.append((value, here))
        elif isinstance(node, yaml.SequenceNode):
            for i, value in enumerate(node.value):
                found.setdefault((*path, i), (value.start_mark.line + 1,
                                              value.start_mark.column + 1))
                stack.append((value, (*path, i)))
    return found


def user_path(loc: tuple, data: object) -> Path_:
    """The part of pydantic's location that names the writer's data: it stops where the data
    does (a union member's tag such as `float` or `list[float]` names no field)."""
    path, here = [], data
    for part in loc:
        if isinstance(here, dict) and part in here:
            here = here[part]
        elif isinstance(here, list) and isinstance(part, int) and 0 <= part < len(here):
            here = here[part]
        else:
            break
        path.append(part)
    return tuple(path)


def _wrong_shape(error_type: str) -> bool:
    return error_type.endswith(("_type", "_parsing")) or error_type in (
        "literal_error", "model_attributes_type", "union_tag_invalid")


def _shape(error_type: str) -> str:
    return next((text for key, text in SHAPES.items() if error_type.startswith(key)),
                "another kind of value")


def _choices(error: dict) -> list[str]:
    expected = (error.get("ctx") or {}).get("expected", "")
    return re.findall(r"'([^']*)'", str(expected))


def did_you_mean(word: object, candidates: list[str]) -> str:
    """' (did you mean 'x'?)' for the closest candidate, or ''."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def one_per_mistake(errors: list[dict], data: object,
                    describe: Callable[[dict, Path_], str]) -> list[tuple[Path_, str]]:
    """(field path, message) per mistake: pydantic's errors grouped by the field the writer
    typed, a union's members merged into one message naming the shapes the field takes;
    `describe(error, path)` words a single error."""
    groups: dict[Path_, list[dict]] = {}
    for error in errors:
        groups.setdefault(user_path(error["loc"], data), []).append(error)
    found = []
    for path, group in groups.items():
        members = [e for e in group if len(e["loc"]) > len(path)
                   and e["type"] != "extra_forbidden"]
        # a member that took the value's shape and refused its value says the most
        specific = [e for e in members if not _wrong_shape(e["type"])]
        if len(members) > 1 and specific:
            found.append((path, describe(specific[0], path)))
        elif len(members) > 1 and len(members) == len(group):
            shapes = list(dict.fromkeys(_shape(e["type"]) for e in members))
            choices = [c for e in members for c in _choices(e)]
            value = _value_at(data, path)
            text = " or ".join(shapes) + (f" ({', '.join(choices)})" if choices else "")
            found.append((path, f"{_dotted(path)}: must be {text}, got {_short(value)}"
                                f"{did_you_mean(value, choices)}"))
        else:
            found += [(path, describe(e, path)) for e in group]
    return found


def _value_at(data: object, path: Path_) -> object:
    for part in path:
        data = data[part]
    return data


def _dotted(path: Path_) -> str:
    return ".".join(str(p) for p in path)


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def at(path: Path_, where: dict[Path_, tuple[int, int]], message: str) -> str:
    """`message` with the line and column of `path` (or of its nearest parent in the text)."""
    for depth in range(len(path), 0, -1):
        if path[:depth] in where:
            line, column = where[path[:depth]]
            return f"line {line}, column {column}: {message}"
    return message
