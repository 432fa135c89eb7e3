"""`moemerge methods [NAME]`: the merge methods and their parameters, from the registry."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.markup import escape

from moemerge.cli.app import app, out, reports_errors
from moemerge.merge.registry import METHOD_NAMES, REGISTRY
from moemerge.terminal_tables import Column, Fitted


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
    from moemerge.merge.reference import default_text, methods_table, weights_text

    if name is None:  # the parameters are `methods NAME`'s: with them, 113 lines at 80 columns
        columns = [Column("method", "left", key=True), Column("inputs", "left"),
                   Column("what it does", "left", prose=True)]
        rows = [[row[0], _inputs(row[2], row[3]), row[1]] for row in methods_table()]
        out.print(Fitted(columns, [[escape(c) for c in row] for row in rows],
                         title="merge methods (docs/merge-methods.md)",
                         caption="inputs: base model (required, or optional) + models merged; "
                                 "`moemerge methods NAME`: a method's parameters and defaults"))
        return
    if name not in REGISTRY:
        raise RecipeError(f"unknown merge method {name!r}; choose from {', '.join(METHOD_NAMES)}")
    spec = REGISTRY[name]
    out.print(f"[bold]{spec.name}[/]: {spec.summary} ({spec.paper})")
    out.print(f"models' weights: {WEIGHTS[weights_text(spec)]}")
    columns = [Column("parameter", "left", key=True), Column("default", "left"),
               Column("values", "left"), Column("tuned", "left"),
               Column("per model", "left"), Column("meaning", "left", prose=True)]
    rows = [[p.name, default_text(p),
             ("list or " if p.kind is float else "") + p.range_text().replace("\\|", "|"),
             "yes" if p.tunable else "", "yes" if p.per_model else "", p.doc]
            for p in spec.params]
    out.print(Fitted(columns, [[escape(c) for c in row] for row in rows])
              if spec.params else "no parameters")


WEIGHTS = {"signed": "signed (a negative weight subtracts a model)",
           "≥ 0": "0 or more, not all 0", "–": "not used"}


def _inputs(base: str, models: str) -> str:
    """'base + ≥ 1': what a method merges, the base (required: base, optional: (base)) and how
    many models, in one column so that the table fits 80 columns."""
    parts = {"yes": ["base"], "optional": ["(base)"], "no": []}[base]
    return " + ".join(parts + ([] if models == "–" else [models]))
