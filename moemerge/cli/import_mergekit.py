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
    from moemerge.io.outputs import check_output, local_inputs, write_output_file
    from moemerge.io.paths import check_output_apart
    from moemerge.recipe.load import load_recipe_data
    from moemerge.recipe.mergekit import convert_documents, render

    if output is not None:  # the config itself, before it is read
        check_output_apart(output, [("the mergekit config", config)])
    data = load_recipe_data(config, documents=True)  # several: mergekit-multi
    # the models it names are inputs of the recipe written: never replaced by it either
    inputs = [("the mergekit config", config),
              *local_inputs("a model the config names", _models(data), near=[config.parent])]
    if output is not None:
        check_output(output, inputs, force=force, option="--output")
    imported = convert_documents(data, str(config))
    text = render(imported, config.name)
    if output is None:
        out.print(text, end="", highlight=False, markup=False, soft_wrap=True)
        return
    write_output_file(output, text, inputs, force=force, option="--output")
    err.print(f"[green]wrote[/] {output} ({imported.kind}, {len(imported.notes)} note(s) in its "
              "comment block)")


MODEL_KEYS = ("model", "base_model", "source_model")  # where mergekit configs name models


def _models(data) -> list[str]:
    """The model references in a loaded mergekit config (any depth, walked with its own
    stack)."""
    from moemerge.recipe.tree import strings

    return [v for k, v in strings(data) if k in MODEL_KEYS and 0 < len(v) < 4096]
