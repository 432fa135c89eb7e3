"""`moemerge import-mergekit`: translate a mergekit-yaml or mergekit-moe config to a recipe."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from moemerge.cli.app import app, err, out, reports_errors


@app.command("import-mergekit")
@reports_errors
def import_mergekit(
    config: Annotated[Path, typer.Argument(help="A mergekit-yaml or mergekit-moe config.",
                                           show_default=False)],
    output: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--output", "-o", help="Write the recipe here (default: print it).",
                     show_default=False),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace OUTPUT if it exists.")] = False,
) -> None:
    """Translate a mergekit config into a moemerge recipe that builds the same model
    (docs/mergekit.md). What it cannot carry is an error, or a note in the recipe's comment
    block."""
    from moemerge.errors import OutputError
    from moemerge.io.paths import check_output_apart
    from moemerge.recipe.load import load_recipe_data
    from moemerge.recipe.mergekit import convert, render

    if output is not None:
        check_output_apart(output, [("the mergekit config", config)])
    imported = convert(load_recipe_data(config), str(config))
    text = render(imported, config.name)
    if output is None:
        out.print(text, end="", highlight=False, markup=False, soft_wrap=True)
        return
    if output.exists() and not force:
        raise OutputError(f"{output} already exists; pass --force to replace it")
    output.write_text(text)
    err.print(f"[green]wrote[/] {output} ({imported.kind}, {len(imported.notes)} note(s) in its "
              "comment block)")
