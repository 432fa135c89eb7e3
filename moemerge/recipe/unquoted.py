"""Numbers are numbers: `lambda: "0.5"` is a mistake (a quoted YAML value is text), refused with
a hint, not quietly converted as pydantic's lax mode would."""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel, ValidationInfo, field_validator


def numeric_only(annotation) -> bool:
    """The field takes numbers (or lists of them, or null), and never text."""
    leaves, stack = [], [annotation]
    while stack:
        item = stack.pop()
        origin = typing.get_origin(item)
        if origin in (typing.Union, types.UnionType, list, tuple, typing.Annotated):
            stack += [a for a in typing.get_args(item)[: 1 if origin is typing.Annotated else None]
                      if a is not Ellipsis]
        elif item is not type(None):
            leaves.append(item)
    return bool(leaves) and all(leaf in (int, float) for leaf in leaves)


class UnquotedNumbers(BaseModel):
    @field_validator("*", mode="before")
    @classmethod
    def _unquoted(cls, value: object, info: ValidationInfo) -> object:
        field = cls.model_fields.get(info.field_name)
        if isinstance(value, str) and field is not None and numeric_only(field.annotation):
            raise ValueError(f"a number, not the text {value[:40]!r}: write it without quotes")
        return value
