"""Words in messages: `plural(3, "model")` is "3 models", `duration(200)` "3 min"."""

from __future__ import annotations


def plural(count: int, noun: str, many: str | None = None) -> str:
    """`count` and `noun`, the noun in the plural unless count is 1 (`many`, else noun + "s");
    thousands separated ("12,288 tokens")."""
    return f"{count:,} {noun if count == 1 else many or noun + 's'}"


def duration(seconds: float) -> str:
    """A time for a person: "40 s", "3 min", "1 h 20 min" (estimates: no false precision)."""
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 90 else f"{minutes // 60} h {minutes % 60} min"
