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
        typer.Option(help="Routing report of the MoE MODEL: NAME=FILE (repeat), a directory of "
                     "<domain>.txt files, or a JSONL file with a label field.",
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
        text = json.dumps(to_dict(report), indent=2) + "\n"
        if json_path == "-":
            sys.stdout.write(text)
        else:
            Path(json_path).write_text(text)
    if markdown is not None:
        markdown.write_text(to_markdown(report))
    if plot is not None:
        plot_png(report, plot)


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
    if json_path == "-":
        sys.stdout.write(report.to_json())
    elif json_path is not None:
        Path(json_path).write_text(report.to_json())
    if plot is not None:
        plot_png(report, plot)


Opt = typer.Option


@app.command()
@_reports_errors
def finetune(
    model: Annotated[
        Optional[str],  # noqa: UP045 - typer needs Optional on 3.10
        typer.Argument(help="MoE model directory (e.g. made by `moemerge build`).",
                       show_default=False, metavar="MODEL_DIR"),
    ] = None,
    output: Annotated[
        Optional[str],  # noqa: UP045
        typer.Argument(help="Output model directory (written atomically).", show_default=False,
                       metavar="OUT"),
    ] = None,
    config: Annotated[Optional[Path], Opt(  # noqa: UP045
        help="YAML file with the same fields (options given here override it).")] = None,
    data: Annotated[Optional[list[str]], Opt(  # noqa: UP045
        help="Text/JSONL file, directory (domain = file stem) or name=path; repeat.")] = None,
    router_only: Annotated[bool, Opt("--router-only", help="Train the routers only "
                                     "(the default).")] = False,
    train: Annotated[Optional[str], Opt(  # noqa: UP045
        help="What to train: 'routers', 'projectors' or 'routers,projectors'.")] = None,
    full: Annotated[bool, Opt("--full", help="Train every parameter.")] = False,
    seq_len: Annotated[Optional[int], Opt(help="Tokens per block [256].")] = None,  # noqa: UP045
    eval_fraction: Annotated[Optional[float], Opt(  # noqa: UP045
        help="Held-out share of each domain's blocks [0.1].")] = None,
    text_field: Annotated[Optional[str], Opt(help="JSONL text field [text].")] = None,  # noqa: UP045
    batch_size: Annotated[Optional[int], Opt(  # noqa: UP045
        help="Blocks per optimizer step over all processes [8].")] = None,
    grad_accum: Annotated[Optional[int], Opt(help="Micro-batches per step [1].")] = None,  # noqa: UP045
    steps: Annotated[Optional[int], Opt(help="Optimizer steps [one epoch].")] = None,  # noqa: UP045
    epochs: Annotated[Optional[float], Opt(help="Passes over the data, if no --steps [1].")] = None,  # noqa: UP045,E501
    lr: Annotated[Optional[float], Opt(help="Peak learning rate [1e-3].")] = None,  # noqa: UP045
    weight_decay: Annotated[Optional[float], Opt(help="AdamW weight decay [0].")] = None,  # noqa: UP045
    schedule: Annotated[Optional[str], Opt(help="cosine | linear | constant [cosine].")] = None,  # noqa: UP045
    warmup_steps: Annotated[Optional[int], Opt(help="Warm-up steps [10% of steps].")] = None,  # noqa: UP045
    max_grad_norm: Annotated[Optional[float], Opt(help="Clip norm, 0 = off [1.0].")] = None,  # noqa: UP045
    aux_loss_coef: Annotated[Optional[float], Opt(  # noqa: UP045
        help="Load-balancing loss coefficient [0].")] = None,
    eval_every: Annotated[Optional[int], Opt(help="Evaluate every N steps [0: end].")] = None,  # noqa: UP045
    seed: Annotated[Optional[int], Opt(help="Seed of data order and RNG [0].")] = None,  # noqa: UP045
    device: Annotated[Optional[str], Opt(help="auto | cpu | cuda [auto].")] = None,  # noqa: UP045
    save_every: Annotated[Optional[int], Opt(  # noqa: UP045
        help="Checkpoint into OUT.checkpoints/ every N steps [0: never].")] = None,
    keep_checkpoints: Annotated[Optional[int], Opt(help="Checkpoints kept [2].")] = None,  # noqa: UP045
    resume: Annotated[bool, Opt("--resume", help="Continue from the latest checkpoint.")] = False,
    force: Annotated[bool, Opt("--force", help="Replace OUT if it exists.")] = False,
    fsdp: Annotated[bool, Opt("--fsdp", help="Shard the model (not supported yet).")] = False,
    trust_remote_code: Annotated[bool, Opt("--trust-remote-code")] = False,
    quiet: Annotated[bool, Opt("--quiet", "-q", help="No tables or progress bar.")] = False,
) -> None:
    """Fine-tune an MoE's routers (default), or everything (--full), on text; write OUT.

    Runs on one process or many: `torchrun --nproc-per-node N -m moemerge finetune ...`."""
    from moemerge.errors import RecipeError
    from moemerge.train.api import finetune as run_finetune
    from moemerge.train.config import make_config

    chosen = [flag for flag, on in (("--router-only", router_only), ("--full", full),
                                    ("--train", train is not None)) if on]
    if len(chosen) > 1:
        raise RecipeError(f"{' and '.join(chosen)}: give only one of --router-only, --train, "
                          "--full")
    parts = (["routers"] if router_only else ["all"] if full
             else [p.strip() for p in train.split(",")] if train is not None else None)
    options = {k: v for k, v in locals().items() if k in _FINETUNE_FIELDS}
    options |= {"train": parts, "data": data or None}
    for flag in ("resume", "force", "fsdp", "trust_remote_code"):
        options[flag] = True if options[flag] else None
    cfg = make_config(config, options)
    result = run_finetune(cfg, console=None if quiet else err)
    after = sum(d["ppl"] for d in result.after.values()) / len(result.after)
    before = sum(d["ppl"] for d in result.before.values()) / len(result.before)
    out.print(f"[green]finetuned[/] {cfg.output} ({result.steps} steps; mean held-out perplexity "
              f"{before:.2f} → {after:.2f})")


_FINETUNE_FIELDS = {
    "model", "output", "seq_len", "eval_fraction", "text_field", "batch_size", "grad_accum",
    "steps", "epochs", "lr", "weight_decay", "schedule", "warmup_steps", "max_grad_norm",
    "aux_loss_coef", "eval_every", "seed", "device", "save_every", "keep_checkpoints", "resume",
    "force", "fsdp", "trust_remote_code",
}
