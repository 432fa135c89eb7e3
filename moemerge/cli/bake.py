"""`moemerge bake`: fold a merged-experts model's curvature into its experts (`export`, its
first name, still runs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moemerge.cli.app import app, out, reports_errors
from moemerge.words import plural


@reports_errors
def bake(
    model: Annotated[Path, typer.Argument(help="A merged_experts model with curvature (e.g. "
                                          "after `finetune --train curvature`).",
                                          show_default=False)],
    output: Annotated[Path, typer.Argument(help="Where the baked model goes.",
                                           show_default=False)],
    force: Annotated[bool, typer.Option("--force", help="Replace OUTPUT if it exists.")] = False,
) -> None:
    """Fold the curvature into the experts, E'_i = E_m + M_i τ_i, and write a model that
    computes the same outputs with no curvature matrices (config curvature: none)."""
    from moemerge.io.atomic import sweep_output
    from moemerge.io.outputs import check_output

    sweep_output(output)  # what a killed bake left, even if this one fails
    check_output(output, [("the input model", model)], force=force, directory=True)
    from moemerge.built.bake import bake_curvature  # torch: after the checks that need none
    baked = bake_curvature(model, output, force=force)
    out.print(f"[green]baked[/] {output}: curvature folded into "
              f"{plural(len(baked), 'expert tensor')}")


app.command("bake")(bake)
app.command("export", hidden=True, help="The first name of `bake`.")(bake)
