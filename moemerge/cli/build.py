"""`moemerge build` and `moemerge validate`."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from moemerge.cli.app import app, err, out, reports_errors
from moemerge.merge.registry import METHOD_SPECS

# from the registry: what --tune-on may vary
TUNABLE = [m.name for m in METHOD_SPECS if "lambda" in m.tunable]
WITH_DENSITY = [m.name for m in METHOD_SPECS if "density" in m.tunable]
RecipeArg = Annotated[
    Path, typer.Argument(help="YAML recipe (see docs/recipes.md).", show_default=False)
]


@app.command()
@reports_errors
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
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress: only warnings, "
                                        "errors and the result (progress goes to stderr, and "
                                        "only to a terminal).")] = False,
    tune_on: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--tune-on", help="Held-out text (any --data source, docs/data.md): "
                     "choose merge lambda and density per tensor role by its perplexity (a "
                     "directory's domains weigh the same: the geometric mean of theirs), then "
                     "build with them (docs/tuning.md). "
                     f"Tunable methods: {', '.join(TUNABLE)}.", show_default=False),
    ] = None,
    tune_lambdas: Annotated[
        str, typer.Option(help="Lambdas tried per role, comma-separated.")
    ] = "0.3,0.5,0.7,1",
    tune_densities: Annotated[
        str, typer.Option(help="Densities tried per role (methods with a density: "
                          f"{', '.join(WITH_DENSITY)}), comma-separated.")
    ] = "0.5,0.7,0.9",
    tune_max_tokens: Annotated[
        int, typer.Option(help="Tokens of the held-out text scored per candidate.")
    ] = 8192,
    tune_seq_len: Annotated[int, typer.Option(help="Window length when scoring.")] = 64,
    strict: Annotated[
        bool, typer.Option("--strict", help="NaN/Inf in an input tensor is an error, not a "
                           "warning.")
    ] = False,
    workers: Annotated[
        int, typer.Option(help="Tensors merged at once, each on its own thread (the output's "
                          "bytes do not depend on it).")
    ] = 1,
    lookahead: Annotated[
        int, typer.Option(help="Tensors read ahead of the one being written: more overlaps "
                          "reading with merging, and holds more in memory (see --dry-run).")
    ] = 3,
    device: Annotated[
        str, typer.Option(help="Where the merge arithmetic runs: cpu, or cuda (reading and "
                          "writing stay on the host).")
    ] = "cpu",
    allow_non_finite: Annotated[
        bool, typer.Option("--allow-non-finite", help="Write output tensors holding NaN/Inf "
                           "(refused by default).")
    ] = False,
    gguf: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--gguf", help="Also write OUTPUT/model-TYPE.gguf with llama.cpp's "
                     "converter; TYPE: f32, f16, bf16 or q8_0 (needs --llama-cpp or "
                     "$LLAMA_CPP_DIR, and the [gguf] extra).", show_default=False),
    ] = None,
    llama_cpp: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--llama-cpp", help="A llama.cpp checkout, or an unpacked llama-cpp-python "
                     "sdist, whose convert_hf_to_gguf.py --gguf runs.", show_default=False),
    ] = None,
) -> None:
    """Build a merged dense model or an MoE from RECIPE into OUTPUT."""
    from moemerge.errors import RecipeError
    from moemerge.progress import Stages

    progress = not quiet and sys.stderr.isatty()
    with Stages(progress)("loading torch and transformers"):
        from moemerge.api import build as run_build

    if verify not in ("auto", "full", "structure"):
        raise RecipeError(f"--verify: must be auto, full or structure, got {verify!r}")
    if output is None and not dry_run:
        raise RecipeError("OUTPUT: missing; give an output directory, or --dry-run")
    converter = (_gguf_converter(recipe, gguf, llama_cpp, allow_pickle) if gguf is not None
                 and not dry_run else None)
    tune = None
    if tune_on is not None:
        from moemerge.tune import TuneOptions

        tune = TuneOptions(
            tune_on, _floats("--tune-lambdas", tune_lambdas),
            _floats("--tune-densities", tune_densities), tune_max_tokens, tune_seq_len,
        )
    result = run_build(
        recipe, output, force=force, dry_run=dry_run, allow_pickle=allow_pickle,
        verify=verify, progress=progress,  # type: ignore[arg-type]
        tune=tune, on_candidate=None if quiet else _print_candidate, strict=strict,
        allow_non_finite=allow_non_finite, warn=_print_warning, workers=workers,
        lookahead=lookahead, device=device,
    )
    if result.tuning is not None:
        from moemerge.tune import tuning_table

        out.print(tuning_table(result.tuning))
    if dry_run:
        from moemerge.report import human_bytes, plan_lines, plan_table

        if out.is_terminal:
            out.print(plan_table(result.plan))
        else:
            print("\n".join(plan_lines(result.plan)))
        if result.estimate is not None:
            err.print(f"output: {human_bytes(result.estimate.output_bytes)}; estimated peak "
                      f"memory: {human_bytes(result.estimate.peak_bytes)} above start-up "
                      f"(lookahead {max(lookahead, workers)})", highlight=False)
        return
    if result.shrunk is not None:
        done = result.shrunk
        out.print(f"[green]shrunk[/] {escape(str(output))}: {done.kept} of {done.before} "
                  f"experts per layer, {done.bytes / 2**20:.1f} MiB")
        return
    size = result.plan.total_bytes / 2**20
    out.print(
        f"[green]built[/] {escape(str(output))} ({len(result.plan.jobs)} tensors, {size:.1f} MiB; "
        f"output check: {result.verified})"
    )
    if converter is not None and output is not None:
        from moemerge.assemble.gguf import write_gguf

        written = write_gguf(output, gguf, converter)  # type: ignore[arg-type]
        out.print(f"[green]wrote[/] {escape(str(written))} "
                  f"({written.stat().st_size / 2**20:.1f} MiB)")


def _gguf_converter(recipe: Path, outtype: str, llama_cpp: Path | None,
                    allow_pickle: bool) -> list[str]:
    """Before any tensor is read: the converter's command, or the error saying how to get it,
    or that the output's layout does not convert (its planned config, from headers only)."""
    from moemerge.api import build as plan_build
    from moemerge.assemble.gguf import (
        check_convertible,
        check_layout_converts,
        check_outtype,
        find_converter,
    )
    from moemerge.recipe.load import load_recipe

    check_outtype(outtype)
    check_convertible(load_recipe(recipe))
    planned = plan_build(recipe, None, dry_run=True, allow_pickle=allow_pickle,
                         progress=False, warn=lambda _message: None)
    check_layout_converts(planned.plan.config)
    return find_converter(llama_cpp)


def _floats(option: str, text: str) -> tuple[float, ...]:
    from moemerge.errors import RecipeError

    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = (math.nan,)
    if not all(map(math.isfinite, values)):
        raise RecipeError(f"{option}: expected comma-separated numbers, all finite, got "
                          f"{text[:80]!r}")
    return values


def _print_warning(message: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _print_candidate(c) -> None:
    setting = "as in the recipe" if c.lam is None else f"lambda {c.lam:g}" + (
        f" density {c.density:g}" if c.density is not None else "")
    err.print(f"[dim]tune {c.role}: {setting}: perplexity {c.perplexity:.4f}[/]", highlight=False)


@app.command()
@reports_errors
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
            err.print(f"[bold red]invalid:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        else:
            out.print(f"[green]ok[/] {escape(str(path))} (kind: {recipe.kind})")
    if failed:
        raise typer.Exit(2)
