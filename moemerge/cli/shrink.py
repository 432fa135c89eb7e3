"""`moemerge shrink`: fewer experts per layer for a token-routed MoE."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moemerge.cli.app import app, out, reports_errors


@app.command()
@reports_errors
def shrink(
    model: Annotated[Path, typer.Argument(help="A token-routed MoE: Mixtral, Qwen2-MoE, "
                                          "Qwen3-MoE, FlexOlmo or GraniteMoE, built by moemerge "
                                          "or not.", show_default=False)],
    output: Annotated[Path, typer.Argument(help="Where the shrunk MoE goes.",
                                           show_default=False)],
    calibration: Annotated[list[str], typer.Option(
        "--calibration", help="Calibration text, in the forms --data takes everywhere (a "
        ".txt or .jsonl file, a directory, name=path; docs/data.md); repeatable. The "
        "statistics and the router repair are computed on it.", show_default=False)],
    experts: Annotated[int | None, typer.Option(
        "--experts", help="Experts kept per layer, K (at most the MoE's; below "
        "experts_per_token, that is clipped to K).", show_default=False)] = None,
    ratio: Annotated[float | None, typer.Option(
        "--ratio", help="Instead of --experts: the share of the experts kept, in (0, 1], "
        "rounded, at least 1.", show_default=False)] = None,
    method: Annotated[str, typer.Option(
        "--method", help="merge: cluster the experts by the cosine similarity of their "
        "outputs into K groups and average each group's weights, weighted by saliency (the "
        "default: on a real 4-expert MoE it lost the least at every K, docs/shrink.md). prune: "
        "keep the K most salient experts of each layer.")] = "merge",
    saliency: Annotated[str, typer.Option(
        "--saliency", help="reap: mean over the tokens routed to an expert of gate weight "
        "times the norm of the vector the expert computes (REAP, Lasby et al. 2025). "
        "frequency: its share of the top-k slots.")] = "reap",
    merge_method: Annotated[str, typer.Option(
        "--merge-method", help="With --method merge: how a group's experts become one. "
        "weighted: their saliency-weighted mean; or a merge method that needs no base model "
        "(karcher, multislerp, average; slerp and nuslerp for groups of two), given the "
        "saliency weights where it takes weights.")] = "weighted",
    no_repair: Annotated[bool, typer.Option(
        "--no-repair", help="Keep the kept (or frequency-averaged) router rows instead of "
        "refitting each router to the original model's routing.")] = False,
    max_tokens: Annotated[int, typer.Option(
        "--max-tokens", help="Calibration tokens read per domain.")] = 4096,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per calibration "
                                         "window.")] = 128,
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
            "merge_method": merge_method, "repair": not no_repair,
            "calibration": {"data": calibration, "max_tokens": max_tokens, "seq_len": seq_len}}
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
