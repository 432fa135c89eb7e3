"""Rich tables that fit the terminal without losing a digit.

A rich Table wider than its console squeezes every column until it fits: numbers end in `…`
(`0.05…`) and headers wrap a letter at a time. `fitted` lays a table out for a given width
instead: each column as wide as its widest cell (values never wrap and are never cut), headers
wrapped at spaces only, a long header (an expert's name) replaced by a short label explained in
the caption, and value columns that still do not fit moved into further tables that repeat the
key columns (`role`, `layer`, `domain`). Without a width, one table of natural widths.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table
from rich.text import Text

LONG_HEADER = 12  # a header word wider than this and than its cells gets a short label


@dataclass(frozen=True)
class Column:
    """One column: `header` (markup-free), `justify`, `key` (repeated in every part), `short`
    (the label used instead of a header longer than LONG_HEADER, e.g. 'E1' for an expert),
    `prose` (text that may wrap at spaces: it takes the width the other columns leave)."""

    header: str
    justify: str = "right"
    key: bool = False
    short: str | None = None
    prose: bool = False


def _cell_width(cell: str) -> int:
    return max((Text.from_markup(line).cell_len for line in cell.split("\n")), default=0)


def _word_width(header: str) -> int:
    return max((Text(word).cell_len for word in header.split()), default=0)


def _table_width(widths: list[int]) -> int:
    return sum(widths) + 3 * len(widths) + 1  # padding 1 each side, a border per column, edge


def _layout(columns: list[Column], rows: list[list[str]]) -> tuple[list[str], list[str], list[int]]:
    """(headers, legend, narrowest widths): a long header becomes its short label."""
    headers = [c.header for c in columns]
    legend = []
    cells = [[(_word_width if c.prose else _cell_width)(r[i]) for r in rows]
             for i, c in enumerate(columns)]
    for i, c in enumerate(columns):
        if c.short and _word_width(c.header) > max([LONG_HEADER, *cells[i]]):
            headers[i] = c.short
            legend.append(f"{c.short} = {c.header}")
    return headers, legend, [max([_word_width(h), *cells[i]]) for i, h in enumerate(headers)]


def table_width(columns: list[Column], rows: list[list[str]], skip: int | None = None) -> int:
    """The narrowest width of one table of all `columns`, not counting column `skip`'s text
    (what is left of a console's width is that column's room)."""
    widths = _layout(columns, rows)[2]
    return _table_width([0 if i == skip else w for i, w in enumerate(widths)])


def _chunks(keys: list[int], values: list[int], widths: list[int], width: int) -> list[list[int]]:
    """Value column indices per part: as many as fit beside the key columns (at least one)."""
    parts: list[list[int]] = []
    for i in values:
        if parts and _table_width([widths[j] for j in keys + parts[-1] + [i]]) <= width:
            parts[-1].append(i)
        else:
            parts.append([i])
    return parts or [[]]


class Fitted:
    """A renderable: the tables of `fitted` for the width of the console it is printed on."""

    def __init__(self, columns: list[Column], rows: list[list[str]], *,
                 title: str | None = None, caption: str | None = None):
        self.columns, self.rows, self.title, self.caption = columns, rows, title, caption

    def __rich_console__(self, console, options):
        for table in fitted(self.columns, self.rows, title=self.title, caption=self.caption,
                            width=options.max_width):
            # title above and caption below, wrapped at the console's width, not the table's
            title, caption, table.title, table.caption = table.title, table.caption, None, None
            if title:
                yield Text.from_markup(str(title), style="table.title")
            yield table
            if caption:
                yield Text.from_markup(str(caption), style="table.caption")


def fitted(columns: list[Column], rows: list[list[str]], *, title: str | None = None,
           caption: str | None = None, width: int | None = None) -> list[Table]:
    """The tables showing `rows` (cells may hold rich markup) in at most `width` columns."""
    headers, legend, widths = _layout(columns, rows)
    keys = [i for i, c in enumerate(columns) if c.key]
    values = [i for i, c in enumerate(columns) if not c.key]
    parts = [values] if width is None else _chunks(keys, values, widths, width)
    caption = "; ".join(filter(None, [caption, ", ".join(legend)])) or None
    tables = []
    for n, part in enumerate(parts, 1):
        shown = keys + part
        table_widths = [widths[i] for i in shown]
        if width is not None:  # room to spare: headers on one line, left to right
            for k, i in enumerate(shown):
                if columns[i].prose:
                    continue
                spare = width - _table_width(table_widths)
                table_widths[k] += max(0, min(spare, Text(headers[i]).cell_len - widths[i]))
        name = title if title is None or len(parts) == 1 else f"{title} ({n}/{len(parts)})"
        table = Table(title=name, title_justify="left", caption=caption, caption_justify="left")
        for i, w in zip(shown, table_widths, strict=True):
            table.add_column(Text(headers[i]), justify=columns[i].justify,  # type: ignore[arg-type]
                             width=None if width is None or columns[i].prose else w,
                             min_width=w if columns[i].prose else None)
        for row in rows:
            table.add_row(*(row[i] for i in shown))
        tables.append(table)
    return tables
