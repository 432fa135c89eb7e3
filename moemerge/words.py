"""Counts in messages: `plural(1, "model")` is "1 model", `plural(3, "model")` "3 models"."""

from __future__ import annotations


def plural(count: int, noun: str, many: str | None = None) -> str:
    """`count` and `noun`, the noun in the plural unless count is 1 (`many`, else noun + "s");
    thousands separated ("12,288 tokens")."""
    return f"{count:,} {noun if count == 1 else many or noun + 's'}"
