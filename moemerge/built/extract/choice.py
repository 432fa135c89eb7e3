"""`--expert NAME` and `--weights w1,w2,...`: which expert (or which mix) to extract."""

from __future__ import annotations

import math

from moemerge.errors import RecipeError
from moemerge.words import plural


def expert_index(given: str, names: list[str]) -> int:
    """The expert `given` names: a name as the recipe gives it, else its index; a wrong one is
    a RecipeError (exit 2, like every bad option) listing the valid ones."""
    if given in names:
        return names.index(given)
    if given.strip().isdigit() and int(given) < len(names):
        return int(given)
    valid = ", ".join(f"{i} ({name!r})" for i, name in enumerate(names))
    raise RecipeError(f"--expert {given!r}: no such expert; give a name or an index: {valid}")


def routing_weights(text: str, names: list[str]) -> list[float]:
    """`--weights` as the scores s [N] the merged FFN is taken at, normalised to sum 1 (the
    router's softmax always does)."""
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise RecipeError(f"--weights {text!r}: give {len(names)} numbers separated by "
                          "commas") from None
    if len(weights) != len(names):
        raise RecipeError(f"--weights: {plural(len(weights), 'number')} for "
                          f"{plural(len(names), 'expert')} "
                          f"({', '.join(names)})")
    if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise RecipeError(f"--weights {text!r}: the weights must be finite, not negative, and "
                          "not all 0")
    return [w / sum(weights) for w in weights]


def one_hot(index: int, count: int) -> list[float]:
    return [float(i == index) for i in range(count)]
