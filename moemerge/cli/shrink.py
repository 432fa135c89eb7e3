"""`moemerge shrink`: fewer experts per layer for a token-routed MoE. Its options are the fields
of the `kind: shrink` recipe it writes as the output's recipe copy (recipe/shrink.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moemerge.cli.app import app, defaults, described, out, reports_errors
from moemerge.recipe.base import CalibrationText
from moemerge.recipe.shrink import ShrinkRecipe

S, C = defaults(ShrinkRecipe), defaults(CalibrationText)


def Option(name: str, *decls: str, **extra):  # noqa: N802 - reads as typer's
    """The typer option of ShrinkRecipe field `name` (or its calibration's), described by it."""
    model = ShrinkRecipe if name in ShrinkRecipe.__pydantic_fields__ else CalibrationText
    return described(model, name, *decls, **extra)


@app.command()
@reports_errors
def shrink(
    model: Annotated[Path, typer.Argument(help=ShrinkRecipe.__pydantic_fields__["model"]
                                          .description, show_default=False)],
    output: Annotated[Path, typer.Argument(help="Where the shrunk MoE goes.",
                                           show_default=False)],
    calibration: Annotated[list[str], Option("calibration", "--calibration",
                                             more=" Repeatable.", show_default=False)],
    experts: Annotated[int | None, Option("experts", "--experts", show_default=False)] = None,
    ratio: Annotated[float | None, Option("ratio", "--ratio", show_default=False)] = None,
    method: Annotated[str, Option("method")] = S["method"],  # checked by the recipe
    saliency: Annotated[str, Option("saliency")] = S["saliency"],
    merge_method: Annotated[str, Option("merge_method")] = S["merge_method"],
    repair: Annotated[bool, Option("repair", "--repair/--no-repair")] = S["repair"],
    merge_sample: Annotated[int, Option("merge_sample")] = S["merge_sample"],
    max_tokens: Annotated[int, Option("max_tokens")] = C["max_tokens"],
    seq_len: Annotated[int, Option("seq_len")] = C["seq_len"],
    text_field: Annotated[str, Option("text_field")] = C["text_field"],
    force: Annotated[bool, typer.Option("--force", help="Replace OUTPUT if it exists.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress on "
                                        "stderr.")] = False,
) -> None:
    """Write a token-routed MoE with fewer experts per layer.

    One forward pass over the calibration text measures, per layer and expert, its routing
    frequency and REAP saliency (and, for merge, its outputs). prune keeps the K most salient
    experts; merge clusters them into K groups and averages each. Each router is then refitted
    (ridge regression, as router.init calibrate) to the original model's routing mapped onto
    the experts kept, unless --no-repair. The output keeps the input's layout, with config.json
    updated, shrink.json and README.md saying what was removed or merged per layer, and a
    kind: shrink recipe copy that moemerge build turns into the same model (docs/shrink.md)."""
    from moemerge.errors import RecipeError
    from moemerge.recipe.load import parse_recipe

    data = {"kind": "shrink", "model": str(model), "method": method, "saliency": saliency,
            "merge_method": merge_method, "repair": repair, "merge_sample": merge_sample,
            "calibration": {"data": calibration, "max_tokens": max_tokens, "seq_len": seq_len,
                            "text_field": text_field}}
    data |= {k: v for k, v in (("experts", experts), ("ratio", ratio)) if v is not None}
    recipe = parse_recipe(data, "options")
    if not model.is_dir():
        raise RecipeError(f"MODEL {model}: no such directory")
    from moemerge.built.shrink import recipe_text_of  # torch: after the usage checks
    from moemerge.built.shrink import shrink as run_shrink

    done = run_shrink(recipe, output, recipe_dir=Path.cwd(), force=force,
                      recipe_text=recipe_text_of(recipe, model, calibration),
                      progress=not quiet)  # bars on a terminal, plain lines elsewhere
    for note in done.notes:
        out.print(f"[yellow]note:[/] {note}", highlight=False)
    out.print(f"[green]shrunk[/] {output}: {done.kept} of {done.before} experts per layer "
              f"({method}), {done.bytes / 2**20:.1f} MiB", highlight=False)
