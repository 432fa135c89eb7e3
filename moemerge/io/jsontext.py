"""JSON read from untrusted files, with an integer too long to convert named by its key.

Python refuses to convert a string of more than 4300 digits to an int (a ValueError from deep
inside `json.loads`, naming nothing); no number moemerge reads has more than a few dozen.
`loads` keeps such a number as a marker and raises `HugeNumber` naming where it is
(`metadata.total_size`, `[3].n`), for the caller to put beside the file.
"""

from __future__ import annotations

import json

MAX_DIGITS = 4000  # below Python's default int_max_str_digits (4300)


class HugeNumber(ValueError):
    """An integer of `digits` digits at `where` (a key path) in a JSON document."""

    def __init__(self, where: str, digits: int):
        self.where, self.digits = where, digits
        super().__init__(f"{where or 'the document'}: an integer of {digits} digits; no "
                         "value moemerge reads is that large")


class _Huge:
    def __init__(self, digits: int):
        self.digits = digits


def _parse_int(text: str):
    return int(text) if len(text) <= MAX_DIGITS else _Huge(len(text.lstrip("-")))


def loads(text: str | bytes) -> object:
    """json.loads; HugeNumber (a ValueError) for an integer of more than MAX_DIGITS digits,
    json.JSONDecodeError (a ValueError too) and RecursionError as json.loads raises them."""
    data = json.loads(text, parse_int=_parse_int)
    found = _find_huge(data, "")
    if found is not None:
        raise HugeNumber(*found)
    return data


def _find_huge(data: object, where: str) -> tuple[str, int] | None:
    stack = [(data, where)]
    while stack:
        value, at = stack.pop()
        if isinstance(value, _Huge):
            return at, value.digits
        if isinstance(value, dict):
            stack.extend((v, f"{at}.{k}" if at else str(k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(value))
    return None
