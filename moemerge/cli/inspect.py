"""`moemerge inspect`: task-vector reports, and routing reports on built MoEs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from moemerge.cli.app import app, err, out, reports_errors


@app.command()
@reports_errors
def inspect(
    models: Annotated[
        Optional[list[str]],  # noqa: UP045 - typer needs Optional on 3.10
        typer.Argument(help="BASE then one or more EXPERTs (local dirs or hub ids); with "
                       "--data, one built MoE MODEL.", metavar="BASE EXPERT | MODEL",
                       show_default=False),
    ] = None,
    recipe: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(help="Take base_model and experts (or models) from this build recipe."),
    ] = None,
    density: Annotated[
        float, typer.Option(help="TIES density for the trimmed-mass statistic.")
    ] = 0.7,
    json_path: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--json", help="Write the report as JSON to this file ('-': stdout)."),
    ] = None,
    plot: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(help="Write cosine heatmaps (one panel per role) to this PNG; with "
                     "--data, routing bars and a heatmap per domain."),
    ] = None,
    markdown: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(help="Write the tables and verdict as markdown (for a model card)."),
    ] = None,
    allow_pickle: Annotated[
        bool, typer.Option("--allow-pickle", help="Accept pickled .bin checkpoints (loaded with "
                           "weights_only=True). Only for files you trust.")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    data: Annotated[
        Optional[list[str]],  # noqa: UP045
        typer.Option(help="Routing report of the MoE MODEL on this text: a file, directory, "
                     "JSONL, saved or hub dataset, or name=path (docs/data.md); repeat.",
                     show_default=False),
    ] = None,
    label_field: Annotated[str, typer.Option(help="JSONL --data: the domain field.")] = "domain",
    text_field: Annotated[str, typer.Option(help="JSONL --data: the text field.")] = "text",
    seq_len: Annotated[int, typer.Option(help="--data: tokens per window.", min=1)] = 256,
    max_tokens: Annotated[
        int, typer.Option(help="--data: tokens read per domain.", min=2)
    ] = 20000,
    per_layer: Annotated[
        bool, typer.Option("--per-layer", help="--data: also a table per layer.")
    ] = False,
) -> None:
    """Task-vector report: per layer and role, how the experts' changes from BASE relate
    (cosine, sign conflicts, norms), and what that means for merging them (docs/inspect.md).

    With --data, routing report instead: `inspect MODEL --data ...` routes each domain's text
    through the built MoE MODEL and reports each expert's share of its tokens per layer, and the
    perplexity. (One command for both: both inspect models before or after a build, and share
    --json and --plot; the positional arguments say which report.)
    """
    import json

    from moemerge.analysis import recipe_models, task_vector_report, verdict
    from moemerge.analysis.render import markdown as to_markdown
    from moemerge.analysis.render import plot as plot_png
    from moemerge.analysis.render import tables, to_dict
    from moemerge.errors import RecipeError

    models = models or []
    if data:
        if recipe is not None or markdown is not None or allow_pickle or len(models) != 1:
            raise RecipeError("--data: give exactly one MODEL (a built MoE directory); "
                              "--recipe, --markdown and --allow-pickle are task-vector options")
        _inspect_routing(Path(models[0]), data, label_field=label_field, text_field=text_field,
                         seq_len=seq_len, max_tokens=max_tokens, per_layer=per_layer,
                         json_path=json_path, plot=plot)
        return
    if recipe is not None:
        if models:
            raise RecipeError("give either BASE EXPERT... or --recipe, not both")
        base, experts = recipe_models(recipe)
    elif len(models) < 2:
        raise RecipeError("give BASE and at least one EXPERT (or --recipe RECIPE)")
    else:
        base, experts = models[0], models[1:]
    if plot is not None and len(experts) < 2:
        raise RecipeError("--plot: cosine heatmaps need at least two experts")
    report = task_vector_report(
        base, experts, density=density, allow_pickle=allow_pickle,
        recipe_dir=recipe.parent if recipe is not None else None,
        progress=not quiet and sys.stderr.isatty(),
    )
    console = err if json_path == "-" else out  # keep stdout pure JSON with --json -
    for table in tables(report):
        console.print(table)
    console.print(f"[bold]verdict:[/] {verdict(report)}", highlight=False)
    if json_path is not None:
        _write_json(json_path, json.dumps(to_dict(report), indent=2) + "\n", "report")
    if markdown is not None:
        markdown.write_text(to_markdown(report))
        _wrote(markdown, "the tables and verdict as markdown")
    if plot is not None:
        plot_png(report, plot)
        _wrote(plot, "cosine heatmaps")


def _write_json(json_path: str, text: str, what: str) -> None:
    if json_path == "-":
        sys.stdout.write(text)
    else:
        Path(json_path).write_text(text)
        _wrote(Path(json_path), f"the {what} as JSON")


def _wrote(path: Path, what: str) -> None:
    """Say what a file option wrote, on stderr (stdout may be the JSON)."""
    from rich.markup import escape

    err.print(f"wrote {what} to {escape(str(path))}", highlight=False)


def _inspect_routing(model: Path, data: list[str], *, json_path: str | None, plot: Path | None,
                     per_layer: bool, **kw) -> None:
    from moemerge.analysis.routing import routing_report_from_dir
    from moemerge.analysis.routing_render import layer_table, summary_table
    from moemerge.analysis.routing_render import plot as plot_png

    report = routing_report_from_dir(model, data, **kw)
    console = err if json_path == "-" else out  # keep stdout pure JSON with --json -
    console.print(summary_table(report))
    if per_layer:
        console.print(layer_table(report))
    if json_path is not None:
        _write_json(json_path, report.to_json(), "routing report")
    if plot is not None:
        plot_png(report, plot)
        _wrote(plot, "routing bars and heatmaps")
