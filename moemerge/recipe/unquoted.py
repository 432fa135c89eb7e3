"""Numbers are numbers: `lambda: "0.5"` is a mistake (a quoted YAML value is text), refused with
a hint, not quietly converted as pydantic's lax mode would."""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel, ValidationInfo, field_validator


def _leaves(annotation) -> list:
    leaves, stack = [], [annotation]
    while stack:
        item = stack.pop()
        origin = typing.get_origin(item)
        if origin in (typing.Union, types.UnionType, list, tuple, typing.Annotated):
            stack += [a for a in typing.get_args(item)[: 1 if origin is typing.Annotated else None]
                      if a is not Ellipsis]
        elif item is not type(None):
            leaves.append(item)
    return leaves


def numeric_only(annotation) -> bool:
    """The field takes numbers (or lists of them, or null), and never text."""
    leaves = _leaves(annotation)
    return bool(leaves) and all(leaf in (int, float) for leaf in leaves)


def numbers_or_words(annotation) -> bool:
    """The field takes a number or one of some words (`experts_per_token: 2 | auto`), not any
    text (`max_shard_size: 5GB | 500` takes "500")."""
    leaves = _leaves(annotation)
    return any(leaf in (int, float) for leaf in leaves) and str not in leaves


def _numeric_text(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


class UnquotedNumbers(BaseModel):
    @field_validator("*", mode="before")
    @classmethod
    def _unquoted(cls, value: object, info: ValidationInfo) -> object:
        field = cls.model_fields.get(info.field_name)
        if isinstance(value, str) and field is not None and (
                numeric_only(field.annotation)
                or (numbers_or_words(field.annotation) and _numeric_text(value))):
            raise ValueError(f"a number, not the text {value[:40]!r}: write it without quotes")
        return value
