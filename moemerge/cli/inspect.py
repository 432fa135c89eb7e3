"""`moemerge inspect`: `task-vectors` (the default) before a build, `routing` of a built MoE."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from moemerge.bounds import MAX_SEQ_LEN, MAX_TOKENS
from moemerge.cli.app import App, Group, app, at_most, err, out, reports_errors
from moemerge.io.outputs import local_inputs

JsonOption = Annotated[
    Optional[str],  # noqa: UP045 - typer needs Optional on 3.10
    typer.Option("--json", help="Write the report as JSON to this file ('-': stdout)."),
]
def force_option(options: str):
    return Annotated[bool, typer.Option("--force", help=f"Replace the files {options} name if "
                                        "they exist.")]


class InspectGroup(Group):
    """`inspect BASE EXPERT...` is `inspect task-vectors BASE EXPERT...` (a first word that is
    not a subcommand starts the task-vector report); the old `inspect MODEL --data ...` is
    `inspect routing MODEL --data ...`, with a deprecation message. Its --help ends with the
    default command's whole help, so `inspect --help` lists the options `inspect BASE EXPERT...`
    takes."""

    default_command = "task-vectors"

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            old_routing = any(a == "--data" or a.startswith("--data=") for a in args)
            if old_routing:
                err.print("[yellow]deprecated:[/] `inspect MODEL --data ...` is now "
                          "`inspect routing MODEL --data ...`", highlight=False)
            args = ["routing" if old_routing else self.default_command, *args]
        return super().parse_args(ctx, args)

    def format_help(self, ctx, formatter):
        super().format_help(ctx, formatter)
        command = self.commands[self.default_command]
        line = f"`inspect BASE EXPERT...` is `inspect {self.default_command} BASE EXPERT...`:"
        if getattr(self, "rich_markup_mode", None) == "rich":  # Typer's rich help prints itself
            out.print(f"\n [bold]{line}[/]", highlight=False)
        else:
            formatter.write_paragraph()
            formatter.write_text(line)
        with command.make_context(self.default_command, [], parent=ctx,
                                  resilient_parsing=True) as sub:
            command.format_help(sub, formatter)


inspect_app = App(
    cls=InspectGroup, no_args_is_help=True, add_completion=False,
    help="Report on models before or after a build: `inspect BASE EXPERT...` (task vectors, "
    "the default) or `inspect routing MODEL --data ...` (a built MoE's routing).")
app.add_typer(inspect_app, name="inspect")


@inspect_app.command("task-vectors")
@reports_errors
def task_vectors(
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
    json_path: JsonOption = None,
    plot: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Write cosine heatmaps (one panel per role) to this PNG.")] = None,
    markdown: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(help="Write the tables and verdict as markdown (for a model card)."),
    ] = None,
    allow_pickle: Annotated[
        bool, typer.Option("--allow-pickle", help="Accept pickled .bin checkpoints (loaded with "
                           "weights_only=True). Only for files you trust.")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    force: force_option("--json, --plot and --markdown") = False,
) -> None:
    """Task-vector report (the default of `inspect`): per layer and role, how the experts'
    changes from BASE relate (cosine, sign conflicts, norms), and what that means for merging
    them (docs/inspect.md)."""
    import json

    from moemerge.errors import RecipeError

    models = models or []  # the usage first, before torch is imported
    if recipe is not None and models:
        raise RecipeError("give either BASE EXPERT... or --recipe, not both")
    if recipe is None and len(models) < 2:
        raise RecipeError("give BASE and at least one EXPERT (or --recipe RECIPE)")
    from moemerge.analysis import recipe_models, task_vector_report, verdict
    from moemerge.analysis.render import markdown as to_markdown
    from moemerge.analysis.render import plot as plot_png
    from moemerge.analysis.render import tables, to_dict

    base, experts = recipe_models(recipe) if recipe is not None else (models[0], models[1:])
    if plot is not None and len(experts) < 2:
        raise RecipeError("--plot: cosine heatmaps need at least two experts")
    near = [recipe.parent] if recipe is not None else []
    inputs = [*local_inputs("the input model", [getattr(m, "model", m) for m in (base, *experts)],
                            near=near),
              *([("the recipe", recipe)] if recipe is not None else [])]
    files = ReportFiles(inputs, force, json=json_path, plot=plot, markdown=markdown)
    report = task_vector_report(
        base, experts, density=density, allow_pickle=allow_pickle,
        recipe_dir=recipe.parent if recipe is not None else None,
        progress=not quiet and sys.stderr.isatty(),
    )
    console = err if json_path == "-" else out  # keep stdout pure JSON with --json -
    for table in tables(report):
        console.print(table)
    console.print(f"[bold]verdict:[/] {verdict(report)}", highlight=False)
    files.json(json.dumps(to_dict(report), indent=2) + "\n", "report")
    files.write("--markdown", to_markdown(report), "the tables and verdict as markdown")
    files.write("--plot", lambda path: plot_png(report, path), "cosine heatmaps")


@inspect_app.command("routing")
@reports_errors
def routing(
    model: Annotated[Path, typer.Argument(help="A built MoE directory.", metavar="MODEL",
                                          show_default=False)],
    data: Annotated[
        list[str],
        typer.Option(help="Text to route: a file, directory, JSONL, saved or hub dataset, or "
                     "name=path (docs/data.md); repeat.", show_default=False),
    ],
    label_field: Annotated[str, typer.Option(help="JSONL data: the domain field.")] = "domain",
    text_field: Annotated[str, typer.Option(help="JSONL data: the text field.")] = "text",
    seq_len: Annotated[int, typer.Option(help="Tokens per window.", min=1)] = 256,
    max_tokens: Annotated[int, typer.Option(help="Tokens read per domain.", min=2)] = 20000,
    per_layer: Annotated[bool, typer.Option("--per-layer", help="Also a table per layer.")
                         ] = False,
    json_path: JsonOption = None,
    plot: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Write routing bars and a heatmap per domain to this PNG.")] = None,
    force: force_option("--json and --plot") = False,
) -> None:
    """Routing report: route each domain's text through the built MoE MODEL and report each
    expert's share of its tokens per layer, and the perplexity (docs/inspect.md)."""
    at_most("--seq-len", seq_len, MAX_SEQ_LEN, "tokens per window")
    at_most("--max-tokens", max_tokens, MAX_TOKENS, "tokens per domain")
    inputs = [("the input model", model), *local_inputs("--data", data)]
    files = ReportFiles(inputs, force, json=json_path, plot=plot)
    # torch: after the usage checks
    from moemerge.analysis.routing import routing_report_from_dir
    from moemerge.analysis.routing_render import layer_table, summary_table
    from moemerge.analysis.routing_render import plot as plot_png

    report = routing_report_from_dir(model, data, label_field=label_field,
                                     text_field=text_field, seq_len=seq_len,
                                     max_tokens=max_tokens)
    console = err if json_path == "-" else out  # keep stdout pure JSON with --json -
    console.print(summary_table(report))
    if per_layer:
        console.print(layer_table(report))
    files.json(report.to_json(), "routing report")
    files.write("--plot", lambda path: plot_png(report, path), "routing bars and heatmaps")


class ReportFiles:
    """The report files a command was asked for (option -> path), checked under moemerge's
    output rule (moemerge.io.outputs) before the report is computed, and written under it."""

    def __init__(self, inputs, force: bool, **paths):
        from moemerge.io.outputs import check_output, plot_suffixes

        self.inputs, self.force = inputs, force
        self.paths = {f"--{k}": Path(v) for k, v in paths.items() if v is not None and v != "-"}
        self.stdout = paths.get("json") == "-"
        for option, path in self.paths.items():
            check_output(path, inputs, force=force, option=option,
                         suffixes=plot_suffixes() if option == "--plot" else None)

    def json(self, text: str, what: str) -> None:
        if self.stdout:
            sys.stdout.write(text)
        self.write("--json", text, f"the {what} as JSON")

    def write(self, option: str, content, what: str) -> None:
        """Write `content` (text, or a function writing the path it is given) to `option`'s
        file, if one was asked for; say so on stderr (stdout may be the JSON)."""
        from rich.markup import escape

        from moemerge.io.outputs import write_output_file

        if option not in self.paths:
            return
        path = write_output_file(self.paths[option], content, self.inputs, force=self.force,
                                 option=option)
        err.print(f"wrote {what} to {escape(str(path))}", highlight=False)
