"""What a finetune run shows and leaves behind: the before/after table per domain, the live
progress bar, metrics.jsonl, loss.png and (when moemerge.analysis.routing is there) the routing
report."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from moemerge.terminal_tables import Column, Fitted

Evals = dict[str, dict[str, float]]


def eval_table(before: Evals, after: Evals | None = None, title: str = "held-out loss") -> Fitted:
    """Rows = domains (+ mean); loss and perplexity before and, if given, after training (as
    many tables as the console's width needs, none cutting a number)."""
    names = ["loss", "ppl"] + (["loss after", "ppl after", "Δ ppl"] if after else [])
    rows = []
    for d in list(before) + ["mean"]:
        b = _row(before, d)
        cells = [f"{b['loss']:.4f}", f"{b['ppl']:.2f}"]
        if after:
            a = _row(after, d)
            change = 100 * (a["ppl"] / b["ppl"] - 1)
            colour = "green" if change < 0 else "red"
            cells += [f"{a['loss']:.4f}", f"{a['ppl']:.2f}", f"[{colour}]{change:+.1f}%[/]"]
        rows.append([escape(d), *cells])
    return Fitted([Column("domain", "left", key=True), *map(Column, names)], rows, title=title)


def _row(evals: Evals, domain: str) -> dict[str, float]:
    if domain != "mean":
        return evals[domain]
    n = len(evals)
    return {k: sum(e[k] for e in evals.values()) / n for k in ("loss", "ppl")}


def step_stats(loss: float | None, tokens_per_s: float | None) -> str:
    """The bar's loss and speed: a dash for each until the first step reports them (not
    'loss nan 0 tok/s')."""
    shown_loss = "–" if loss is None else f"{loss:.4f}"
    shown_tps = "–" if tokens_per_s is None else f"{tokens_per_s:,.0f}"
    return f"loss {shown_loss}  {shown_tps} tok/s"


@contextmanager
def progress_bar(console: Console | None, total: int, start: int) -> Iterator:
    """Yields update(record); a rich bar with step, loss, tokens/s and ETA (or nothing)."""
    if console is None:
        yield lambda record: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[stats]}"), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task("train", total=total, completed=start,
                            stats=step_stats(None, None))

        def update(record: dict) -> None:
            if record["type"] == "train":
                bar.update(task, completed=record["step"],
                           stats=step_stats(record["loss"], record["tokens_per_s"]))

        yield update


def write_metrics(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def loss_plot(path: Path, records: list[dict]) -> None:
    """Training loss per step and held-out mean loss at each evaluation (a Figure, no pyplot)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=120)
    ax = fig.add_subplot()
    train = [r for r in records if r["type"] == "train"]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train", lw=1)
    evals = [r for r in records if r["type"] == "eval"]
    if evals:
        means = [sum(d["loss"] for d in r["domains"].values()) / len(r["domains"]) for r in evals]
        ax.plot([r["step"] for r in evals], means, "o-", label="held-out (mean of domains)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


