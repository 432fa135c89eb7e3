"""Every mistake of a mergekit config at once: each check that can run on its own runs, and
their errors are raised together (a step that needs an earlier one's result still waits)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from moemerge.errors import RecipeError

T, R = TypeVar("T"), TypeVar("R")


class Problems:
    def __init__(self) -> None:
        self.found: list[str] = []

    @contextmanager
    def check(self) -> Iterator[None]:
        """Run the block; its RecipeError is kept, and the checks after it still run."""
        try:
            yield
        except RecipeError as exc:
            self.found.append(str(exc))

    def each(self, items: Iterable[T], convert: Callable[[int, T], R]) -> list[R]:
        """convert(i, item) for every item whose conversion does not fail."""
        out = []
        for i, item in enumerate(items):
            with self.check():
                out.append(convert(i, item))
        return out

    def raise_any(self) -> None:
        """One RecipeError holding every problem kept so far, if there is any."""
        if len(self.found) == 1:
            raise RecipeError(self.found[0])
        if self.found:
            lines = "\n".join(f"  - {p.replace(chr(10), chr(10) + '    ')}" for p in self.found)
            raise RecipeError(f"{len(self.found)} problems:\n{lines}")
