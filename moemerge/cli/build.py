"""`moemerge build` and `moemerge validate`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from moemerge.build_options import BuildOptions, TuneOptions, build_options, tune_options
from moemerge.cli.app import app, defaults, described, err, out, reports_errors
from moemerge.merge.registry import METHOD_SPECS
from moemerge.words import duration, plural

# from the registry: what --tune-on may vary
TUNABLE = [m.name for m in METHOD_SPECS if "lambda" in m.tunable]
WITH_DENSITY = [m.name for m in METHOD_SPECS if "density" in m.tunable]
RecipeArg = Annotated[
    Path, typer.Argument(help="YAML recipe (see docs/recipes.md).", show_default=False)
]


def Option(name: str, *decls: str, model=BuildOptions, **extra):  # noqa: N802 - reads as typer's
    """The typer option of field `name` of BuildOptions (or TuneOptions), described by it."""
    return described(model, name, *decls, **extra)


D, T = defaults(BuildOptions), defaults(TuneOptions)


def _listed(values: tuple[float, ...]) -> str:
    return ",".join(f"{v:g}" for v in values)


@app.command()
@reports_errors
def build(
    recipe: RecipeArg,
    output: Annotated[
        Optional[Path],  # noqa: UP045 - typer needs Optional on 3.10
        typer.Argument(help="Output directory (created; written atomically).", show_default=False),
    ] = None,
    dry_run: Annotated[bool, Option("dry_run", "--dry-run")] = False,
    force: Annotated[bool, Option("force", "--force")] = False,
    allow_pickle: Annotated[bool, Option("allow_pickle", "--allow-pickle")] = False,
    verify: Annotated[str, Option("verify")] = D["verify"],
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress: only warnings, "
                                        "errors and the result (progress goes to stderr: bars "
                                        "on a terminal, plain lines otherwise).")] = False,
    tune_on: Annotated[
        Optional[Path],  # noqa: UP045
        Option("text", "--tune-on", model=TuneOptions, show_default=False,
               more=f" Tunable methods: {', '.join(TUNABLE)}."),
    ] = None,
    tune_lambdas: Annotated[str, Option("lambdas", model=TuneOptions)] = _listed(T["lambdas"]),
    tune_densities: Annotated[str, Option("densities", model=TuneOptions,
                                          more=f" They are: {', '.join(WITH_DENSITY)}.")
                              ] = _listed(T["densities"]),
    tune_max_tokens: Annotated[int, Option("max_tokens", model=TuneOptions)] = T["max_tokens"],
    tune_seq_len: Annotated[int, Option("seq_len", model=TuneOptions)] = T["seq_len"],
    tune_budget: Annotated[Optional[float],  # noqa: UP045
                           Option("budget", model=TuneOptions, show_default=False)] = None,
    strict: Annotated[bool, Option("strict", "--strict")] = False,
    workers: Annotated[int, Option("workers")] = D["workers"],
    lookahead: Annotated[int, Option("lookahead")] = D["lookahead"],
    device: Annotated[str, Option("device")] = D["device"],
    allow_non_finite: Annotated[bool, Option("allow_non_finite", "--allow-non-finite")] = False,
    gguf: Annotated[
        Optional[str], Option("gguf", "--gguf", show_default=False)  # noqa: UP045
    ] = None,
    llama_cpp: Annotated[
        Optional[Path], Option("llama_cpp", "--llama-cpp", show_default=False)  # noqa: UP045
    ] = None,
    gguf_timeout: Annotated[
        Optional[float], Option("gguf_timeout", "--gguf-timeout", show_default=False)  # noqa: UP045
    ] = None,
) -> None:
    """Build a merged dense model or an MoE from RECIPE into OUTPUT."""
    from moemerge.errors import RecipeError
    from moemerge.progress import Stages

    # usage first: a mistake is said at once, not after the seconds torch takes to import
    if output is None and not dry_run:
        raise RecipeError("OUTPUT: missing; give an output directory, or --dry-run")
    tune = None if tune_on is None else tune_options(
        tune_on, lambdas=tune_lambdas, densities=tune_densities, max_tokens=tune_max_tokens,
        seq_len=tune_seq_len, budget=tune_budget)
    options = build_options(
        dry_run=dry_run, force=force, allow_pickle=allow_pickle, verify=verify, strict=strict,
        allow_non_finite=allow_non_finite, workers=workers, lookahead=lookahead, device=device,
        tune=tune, gguf=gguf, llama_cpp=llama_cpp, gguf_timeout=gguf_timeout)
    progress = not quiet
    with Stages(progress)("loading torch and transformers"):
        from moemerge.api import build_file

    result = build_file(recipe, output, options, progress=progress, warn=_print_warning,
                        on_candidate=None if quiet else _print_candidate)
    if result.tuning is not None:
        from moemerge.tune import tuning_table

        out.print(tuning_table(result.tuning))
    if dry_run:
        from moemerge.rendering import human_bytes, plan_lines, plan_table

        if out.is_terminal:
            out.print(plan_table(result.plan))
        else:
            print("\n".join(plan_lines(result.plan)))
        for line in result.plan.decided_later:
            err.print(f"after writing: {escape(line)}", highlight=False)
        if result.estimate is not None:
            err.print(f"output: {human_bytes(result.estimate.output_bytes)}; estimated peak "
                      f"memory: {human_bytes(result.estimate.peak_bytes)} above start-up "
                      f"(lookahead {max(lookahead, workers)})", highlight=False)
        return
    if result.whole is not None:  # a kind with no plan: its runner says what it made
        out.print(f"[green]{result.whole.verb}[/] {escape(str(output))}: "
                  f"{escape(result.whole.summary())}")
        _say_remote_code(output)
        return
    size = result.plan.total_bytes / 2**20
    checked = result.loaded or result.verified  # "loaded in transformers as ..., logits finite"
    out.print(
        f"[green]built[/] {escape(str(output))} ({plural(len(result.plan.jobs), 'tensor')}, "
        f"{size:.1f} MiB; output check: {checked})", highlight=False
    )
    _say_remote_code(output)
    if result.gguf is not None:
        out.print(f"[green]wrote[/] {escape(str(result.gguf))} "
                  f"({result.gguf.stat().st_size / 2**20:.1f} MiB)")


def _say_remote_code(output: Path) -> None:
    """Where the output runs modeling code of its own (seq_routed, bridged, merged_experts, a
    DeepSeek layout), how to load it: a plain from_pretrained refuses it."""
    import json

    from moemerge.finish.remote_code import load_call, needs_remote_code

    config = output / "config.json"
    if config.is_file() and needs_remote_code(json.loads(config.read_text())):
        out.print(f"load it with {load_call(repr(str(output)))}: its modeling code, beside the "
                  "weights, is a copy of moemerge's", markup=False, highlight=False,
                  soft_wrap=True)  # one line: the call is copied whole


def _print_warning(message: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _print_candidate(c, progress) -> None:
    setting = "as in the recipe" if c.lam is None else f"lambda {c.lam:g}" + (
        f" density {c.density:g}" if c.density is not None else "")
    left = (f", about {duration(progress.seconds_left)} left"
            if progress.done < progress.total else "")
    err.print(f"[dim]tune {c.role}: {setting}: perplexity {c.perplexity:.4f} "
              f"({progress.done}/{progress.total}, best {progress.best:.4f}{left})[/]",
              highlight=False)


@app.command()
@reports_errors
def validate(
    recipes: Annotated[list[Path], typer.Argument(help="One or more recipe files.")],
) -> None:
    """Check recipes without reading any model: every mistake at once, each with its line and
    column, and local model paths that do not exist (hub ids are not checked: that needs the
    network). Exit 2 if any recipe has one."""
    from moemerge.errors import RecipeError
    from moemerge.recipe.load import load_recipe

    failed = 0
    for path in recipes:
        try:
            recipe = load_recipe(path)
            problems, hub = _input_problems(recipe, path)
            if problems:
                raise RecipeError(f"{path}: " + ("1 problem" if len(problems) == 1 else
                                                 f"{len(problems)} problems") + ":\n"
                                  + "\n".join(f"  - {p}" for p in problems))
        except RecipeError as exc:
            failed += 1
            err.print(f"[bold red]invalid:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        else:
            unchecked = (f"; hub ids, not checked (that needs the network): {', '.join(hub)}"
                         if hub else "")
            out.print(f"[green]ok[/] {escape(str(path))} (kind: {recipe.kind}{escape(unchecked)})")
    if failed:
        raise typer.Exit(2)


def _input_problems(recipe, path: Path) -> tuple[list[str], list[str]]:
    """(what `build` would refuse before reading any weights: local model directories that do
    not exist, an unknown output layout; the hub ids, which only the hub can check)."""
    from moemerge.architectures.tables import built_layouts
    from moemerge.io.resolve import looks_like_path
    from moemerge.recipe.diagnose import did_you_mean
    from moemerge.recipe.kinds import labelled_refs

    near = Path(path).resolve().parent
    problems, hub = [], []
    for label, ref in labelled_refs(recipe):
        for what, name in (("model", ref.model), ("LoRA adapter", getattr(ref, "lora", None))):
            if name is None:
                continue
            places = [near / name, Path(name).expanduser()]
            if any(p.is_dir() for p in places):
                continue
            if not looks_like_path(name, (near,)):
                hub.append(name)
            elif any(p.exists() for p in places):
                problems.append(f"{what} {label}: {name} is a file; a {what} is a directory")
            else:
                problems.append(f"{what} {label}: no directory {name} (looked next to the "
                                f"recipe, in {near}, and in the working directory)")
    layout = getattr(recipe, "layout", None)
    if layout is not None and layout not in built_layouts():
        problems.append(f"layout: {layout!r} is not one of {', '.join(built_layouts())}"
                        f"{did_you_mean(layout, list(built_layouts()))}")
    return problems, hub
