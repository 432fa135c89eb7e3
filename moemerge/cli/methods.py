"""`moemerge methods [NAME]`: the merge methods and their parameters, from the registry."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from moemerge.cli.app import app, out, reports_errors
from moemerge.merge.registry import METHOD_NAMES, REGISTRY


@app.command()
@reports_errors
def methods(
    name: Annotated[
        Optional[str],  # noqa: UP045
        typer.Argument(help=f"One method: {', '.join(METHOD_NAMES)}.", show_default=False),
    ] = None,
) -> None:
    """List the merge methods (or one method's parameters) a recipe's `merge` block takes."""
    from moemerge.errors import RecipeError
    from moemerge.merge.reference import default_text, methods_table

    if name is None:
        table = Table(title="merge methods (docs/merge-methods.md)")
        for column in ("method", "what it does", "base", "models", "parameters (default)"):
            table.add_column(column)
        for row in methods_table():
            table.add_row(*row[:4], row[4].replace("`", ""))
        out.print(table)
        return
    if name not in REGISTRY:
        raise RecipeError(f"unknown merge method {name!r}; choose from {', '.join(METHOD_NAMES)}")
    spec = REGISTRY[name]
    out.print(f"[bold]{spec.name}[/]: {spec.summary} ({spec.paper})")
    table = Table()
    for column in ("parameter", "default", "values", "tuned", "meaning"):
        table.add_column(column)
    for p in spec.params:
        values = ("list or " if p.kind is float else "") + p.range_text().replace("\\|", "|")
        table.add_row(p.name, default_text(p), values, "yes" if p.tunable else "", p.doc)
    out.print(table if spec.params else "no parameters")
