"""User-derived strings (model names, paths, prompts, error messages) are printed as they are:
rich reads "[code, prose, math]" as markup and drops it unless it is escaped."""

from __future__ import annotations

import torch
from rich.console import Console

from moemerge.cli.app import reports_errors
from moemerge.errors import RecipeError
from moemerge.plan.jobs import Job, Plan, Source
from moemerge.plan.params import ResolvedMerge
from moemerge.rendering import plan_table

NAMES = ["[code]", "[bold]prose", "math[/]"]


def rendered(renderable) -> str:
    console = Console(record=True, force_terminal=True, width=400)
    console.print(renderable)
    return console.export_text()


def test_the_plan_table_keeps_bracketed_names():
    job = Job("model.norm.weight", (4,), torch.float32, "merge", "norm",
              sources=tuple(Source(i, "model.norm.weight") for i in range(3)),
              merge=ResolvedMerge("average"))
    text = rendered(plan_table(Plan(NAMES, [job], {})))
    assert "average of [[code], [bold]prose, math[/]]" in text
    assert "inputs: [code], [bold]prose, math[/]" in text


def test_error_messages_keep_their_brackets(capsys):
    @reports_errors
    def fails():
        raise RecipeError("r.yaml: experts: [code, prose] [/] is not valid")

    try:
        fails()
    except BaseException as exc:  # typer.Exit
        assert getattr(exc, "exit_code", None) == 2
    assert "experts: [code, prose] [/] is not valid" in capsys.readouterr().err
