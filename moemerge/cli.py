"""The `moemerge` command: thin Typer commands over `moemerge.api` and `moemerge.demo`.

Exit codes scripts can rely on: 0 success, 1 runtime error (bad or missing checkpoint, mismatch
between models, failed output check), 2 recipe or usage error, 130 interrupted.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from moemerge import __version__
from moemerge.errors import MoemergeError

app = typer.Typer(
    name="moemerge",
    help="Turn dense expert LLM checkpoints into Mixture-of-Experts models.\n\n"
    "Start with `moemerge demo`: it makes tiny experts offline, builds an MoE from them and "
    "prints per-domain perplexities.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)


def _reports_errors(command: Callable) -> Callable:
    """Turn moemerge's own errors into one red paragraph and the error's exit code."""

    @wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except MoemergeError as exc:
            err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            err.print("[yellow]interrupted; no output was left behind[/]")
            raise typer.Exit(130) from None

    return run


def _version(value: bool) -> None:
    if value:
        out.print(f"moemerge {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """Turn dense expert LLM checkpoints into Mixture-of-Experts models."""


RecipeArg = Annotated[
    Path, typer.Argument(help="YAML recipe (see docs/recipes.md).", show_default=False)
]


@app.command()
@_reports_errors
def build(
    recipe: RecipeArg,
    output: Annotated[
        Optional[Path],  # noqa: UP045 - typer needs Optional on 3.10
        typer.Argument(help="Output directory (created; written atomically).", show_default=False),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print every output tensor and how it is made; "
                           "reads headers only, writes nothing.")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace OUTPUT if it exists.")] = False,
    allow_pickle: Annotated[
        bool, typer.Option("--allow-pickle", help="Accept pickled .bin checkpoints (loaded with "
                           "weights_only=True). Only for files you trust.")
    ] = False,
    verify: Annotated[
        str, typer.Option(help="Check of the output: 'full' loads it in transformers, "
                          "'structure' checks every tensor's name, shape and dtype; 'auto' does "
                          "'full' up to 2 GiB.")
    ] = "auto",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Build a merged dense model or an MoE from RECIPE into OUTPUT."""
    from moemerge.api import build as run_build
    from moemerge.errors import RecipeError

    if verify not in ("auto", "full", "structure"):
        raise RecipeError(f"--verify: must be auto, full or structure, got {verify!r}")
    if output is None and not dry_run:
        raise RecipeError("OUTPUT: missing; give an output directory, or --dry-run")
    result = run_build(
        recipe, output, force=force, dry_run=dry_run, allow_pickle=allow_pickle,
        verify=verify, progress=not quiet and sys.stderr.isatty(),  # type: ignore[arg-type]
    )
    if dry_run:
        from moemerge.report import plan_lines, plan_table

        if out.is_terminal:
            out.print(plan_table(result.plan))
        else:
            print("\n".join(plan_lines(result.plan)))
        for note in result.plan.notes:
            out.print(f"[yellow]note:[/] {note}")
        return
    size = result.plan.total_bytes / 2**20
    out.print(
        f"[green]built[/] {output} ({len(result.plan.jobs)} tensors, {size:.1f} MiB; "
        f"output check: {result.verified})"
    )


@app.command()
@_reports_errors
def validate(
    recipes: Annotated[list[Path], typer.Argument(help="One or more recipe files.")],
) -> None:
    """Check recipes without reading any model: reports every error at once (exit 2 if any)."""
    from moemerge.errors import RecipeError
    from moemerge.recipe.load import load_recipe

    failed = 0
    for path in recipes:
        try:
            recipe = load_recipe(path)
        except RecipeError as exc:
            failed += 1
            err.print(f"[bold red]invalid:[/] {exc}", highlight=False, soft_wrap=True)
        else:
            out.print(f"[green]ok[/] {path} (kind: {recipe.kind})")
    if failed:
        raise typer.Exit(2)


@app.command()
@_reports_errors
def toy(
    directory: Annotated[Path, typer.Argument(help="Where to put base/ and experts/<domain>/.")],
    preset: Annotated[str, typer.Option(help="'demo' (hidden 64) or 'tiny' (hidden 32).")] = "demo",
    force: Annotated[bool, typer.Option("--force", help="Replace DIRECTORY if it exists.")] = False,
) -> None:
    """Make tiny domain experts offline (cached) and copy them to DIRECTORY.

    A small Llama is trained on real text always at hand (CPython's stdlib code, its docstrings,
    generated math problems), then branched into one expert per domain. The bundled recipes in
    recipes/ expect them in recipes/toy.
    """
    from moemerge.demo import materialise_toy_set, preset_spec

    toyset = materialise_toy_set(preset_spec(preset), directory, force=force)
    out.print(f"[green]toy experts[/] in {directory}: base + {', '.join(toyset.experts)}")


@app.command()
@_reports_errors
def demo(
    workdir: Annotated[
        Path, typer.Option(help="Where the toy experts, recipes and built models go.")
    ] = Path("moemerge-demo"),
    preset: Annotated[str, typer.Option(help="'demo' (hidden 64) or 'tiny' (hidden 32).")] = "demo",
) -> None:
    """End to end on tiny offline experts: make them, build the bundled MoE and dense-merge
    recipes, and print each model's perplexity per domain."""
    from moemerge.demo import run_demo

    table = run_demo(workdir, preset_name=preset, console=err)
    out.print(table)


@app.command()
@_reports_errors
def inspect(
    models: Annotated[
        Optional[list[str]],  # noqa: UP045 - typer needs Optional on 3.10
        typer.Argument(help="BASE then one or more EXPERTs (local dirs or hub ids).",
                       metavar="BASE EXPERT", show_default=False),
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
        typer.Option(help="Write cosine heatmaps (one panel per role) to this PNG."),
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
) -> None:
    """Task-vector report: per layer and role, how the experts' changes from BASE relate
    (cosine, sign conflicts, norms), and what that means for merging them (docs/inspect.md)."""
    import json

    from moemerge.analysis import recipe_models, task_vector_report, verdict
    from moemerge.analysis.render import markdown as to_markdown
    from moemerge.analysis.render import plot as plot_png
    from moemerge.analysis.render import tables, to_dict
    from moemerge.errors import RecipeError

    models = models or []
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
        text = json.dumps(to_dict(report), indent=2) + "\n"
        if json_path == "-":
            sys.stdout.write(text)
        else:
            Path(json_path).write_text(text)
    if markdown is not None:
        markdown.write_text(to_markdown(report))
    if plot is not None:
        plot_png(report, plot)


def run() -> None:  # pragma: no cover - console-script entry for `python -m moemerge`
    app()
