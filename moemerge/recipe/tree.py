"""Walks over parsed YAML data (recipes, mergekit configs) with an explicit stack: the data's
depth is the user's, so no walk recurses on it."""

from __future__ import annotations

from collections.abc import Callable, Iterator


def strings(value: object) -> Iterator[tuple[str | None, str]]:
    """(key, string) for every string under `value`, depth first in document order; `key` is
    the mapping key it sits under (a list's items take their list's key), None at the top."""
    stack: list[tuple[str | None, object]] = [(None, value)]
    while stack:
        key, item = stack.pop()
        if isinstance(item, dict):
            stack.extend(reversed([(k, v) for k, v in item.items()]))
        elif isinstance(item, list):
            stack.extend(reversed([(key, v) for v in item]))
        elif isinstance(item, str):
            yield key, item


def replaced(value: object, change: Callable[[str | None, str], str]) -> object:
    """A copy of `value` with every string s under key k replaced by change(k, s) (keys as in
    `strings`); mappings and lists are new, everything else shared."""
    def copy(key: str | None, item: object) -> object:
        if isinstance(item, dict):
            new: object = dict.fromkeys(item)
        elif isinstance(item, list):
            new = [None] * len(item)
        else:
            return change(key, item) if isinstance(item, str) else item
        todo.append((key, item, new))
        return new

    todo: list[tuple[str | None, object, object]] = []
    top = copy(None, value)
    while todo:
        key, item, new = todo.pop()
        if isinstance(item, dict):
            for k, v in item.items():
                new[k] = copy(k, v)  # type: ignore[index]
        else:
            for i, v in enumerate(item):  # type: ignore[arg-type]
                new[i] = copy(key, v)  # type: ignore[index]
    return top
