"""`moemerge route`: the experts a sequence-routed MoE picks for each prompt."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from moemerge.bounds import MAX_SEQ_LEN
from moemerge.cli.app import app, at_most, err, out, reports_errors
from moemerge.cli.inspect import ReportFiles
from moemerge.io.outputs import local_inputs
from moemerge.words import plural

PREVIEW = 60  # characters of each prompt shown in the table


@app.command()
@reports_errors
def route(
    model: Annotated[Path, typer.Argument(help="A seq_routed or bridged model directory.",
                                          show_default=False)],
    prompts: Annotated[list[str], typer.Argument(
        help="Text files (cut by --split), .jsonl files (one prompt per record), directories "
        "of them, or any other --data source (docs/data.md).",
        show_default=False)],
    router: Annotated[
        Optional[str],  # noqa: UP045 - typer needs Optional on 3.10
        typer.Option(help="Route with this instead of the model's own router: learned, "
                     "perplexity, or task_vector (needs a model built with it)."),
    ] = None,
    k: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option("-k", "--experts-per-sequence", help="Route each prompt to this many "
                     "experts instead of the model's own k.", min=1),
    ] = None,
    temperature: Annotated[
        Optional[float],  # noqa: UP045
        typer.Option(help="Softmax temperature of the weights instead of the model's own "
                     "(lower: more decisive)."),
    ] = None,
    split: Annotated[
        str, typer.Option(help="Text files: one prompt per blank-line 'paragraph' (a "
                          "multi-line code block stays whole), per 'line', or per 'file'.")
    ] = "paragraph",
    text_field: Annotated[str, typer.Option(help="JSONL: the prompt's field.")] = "text",
    max_tokens: Annotated[int, typer.Option(help="Tokens of each prompt routed on.",
                                            min=1)] = 2048,
    json_path: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--json", help="Write the routing as JSON to this file ('-': stdout)."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace the --json file if it exists.")
                     ] = False,
) -> None:
    """Print, for each prompt, the experts it is routed to and their weights.

    The routing is the one generate() makes on a prompt and keeps for every generated token:
    learned (router on the mean token embedding), perplexity (one forward per expert, weights
    softmax over the top-k log(1/PPL): each expert's 1/PPL, normalised) or task_vector (one
    forward and backward of the base).
    """
    from moemerge.errors import RecipeError
    from moemerge.terminal_tables import Column, Fitted

    at_most("--max-tokens", max_tokens, MAX_SEQ_LEN, "tokens of a prompt")
    if split not in ("line", "paragraph", "file"):
        raise RecipeError(f"--split: must be line, paragraph or file, got {split!r}")
    if router is not None and router not in ("learned", "perplexity", "task_vector"):
        raise RecipeError(f"--router: must be learned, perplexity or task_vector, got {router!r}")
    if temperature is not None and not temperature > 0:
        raise RecipeError(f"--temperature: must be > 0, got {temperature:g}")
    files = ReportFiles([("the input model", model), *local_inputs("PROMPTS", prompts)], force,
                        json=json_path)
    from moemerge.analysis.route import read_prompts, route_prompts  # torch: after the usage

    texts = read_prompts(prompts, split=split, text_field=text_field)
    report = route_prompts(model, texts, router=router, k=k, temperature=temperature,
                           max_tokens=max_tokens)

    console = err if json_path == "-" else out  # keep stdout pure JSON with --json -
    by_ppl = report.router == "perplexity"
    columns = [Column("#", key=True), Column("prompt", "left", key=True), Column("tokens"),
               Column("experts (weight, perplexity)" if by_ppl else "experts (weight)", "left")]
    rows = [[str(i), "", str(p.tokens), "\n".join(escape(expert_cell(e)) for e in p.experts)]
            for i, p in enumerate(report.prompts)]  # one expert per line
    room = _prompt_room(console.width, columns, rows)
    for row, p in zip(rows, report.prompts, strict=True):
        preview = p.text.replace("\n", "⏎")
        row[1] = escape(preview if len(preview) <= room else preview[: room - 1] + "…")
    table = Fitted(columns, rows, title=f"routing of {plural(len(texts), 'prompt')} by "
                   f"{report.router} routing (top-{report.experts_per_sequence} of "
                   f"{len(report.experts)})")
    console.print(table)
    console.print(weights_legend(report), highlight=False)
    counts = {name: sum(p.experts[0]["name"] == name for p in report.prompts)
              for name in report.experts}
    console.print("first choice: " + ", ".join(f"{n} {c}" for n, c in counts.items()),
                  highlight=False)
    files.json(report.to_json(), "routing")


def _prompt_room(width: int, columns: list, rows: list[list[str]]) -> int:
    """Characters of each prompt's preview: what the console's width leaves beside the other
    columns (whole), at most PREVIEW, at least 12. The preview is an excerpt, cut with `…`."""
    from moemerge.terminal_tables import table_width

    others = table_width(columns, rows, skip=1)
    return max(12, min(PREVIEW, width - others))


def expert_cell(e: dict) -> str:
    """'code (0.51, ppl 3.2)': an expert's weight and, under perplexity routing, its perplexity."""
    ppl = f", ppl {e['perplexity']:.1f}" if "perplexity" in e else ""
    return f"{e['name']} ({e['weight']:.2f}{ppl})"


def weights_legend(report) -> str:
    """What the table's numbers mean: the weights are the mix generate() uses for the prompt."""
    inverse = report.perplexity_score == "inverse"  # a model built before log(1/PPL) scores
    scores = {"learned": "the router's logits", "perplexity": "1/PPL" if inverse else
              "log(1/PPL)", "task_vector": "cos(-gradient, task vector)"}[report.router]
    legend = (f"weight: each expert's share of the mixed output, softmax of {scores} over the "
              f"top k at temperature {report.temperature:g}")
    if report.router != "perplexity":
        return legend
    legend += "; ppl: the expert's perplexity on the prompt (lower fits better), the evidence"
    # The temperature at which the median prompt's first choice gets weight 0.9 over its
    # second: sigmoid(gap / T) = 0.9, T = gap / ln 9. (1/PPL scores of LMs are small and close,
    # 0.016 vs 0.008 for the TINY experts on code, so at temperature 1 they weigh ~0.5 each.)
    score = (lambda ppl: 1 / ppl) if inverse else (lambda ppl: -math.log(ppl))
    gaps = sorted(score(p.experts[0]["perplexity"]) - score(p.experts[1]["perplexity"])
                  for p in report.prompts if len(p.experts) > 1)
    if gaps and gaps[len(gaps) // 2] > 0:
        legend += (f"; --temperature {gaps[len(gaps) // 2] / math.log(9):.1g} would give the "
                   "median prompt's first choice weight 0.9")
    return legend
