"""Terminal renderings of moemerge objects (rich tables)."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from moemerge.plan.jobs import Plan


def human_bytes(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _plan_rows(plan: Plan, times: str) -> list[tuple[str, str, str, str]]:
    """(tensor, shape, dtype, operation) per job; `times` joins the shape's dimensions."""
    return [
        (job.output, times.join(map(str, job.shape)), str(job.dtype).removeprefix("torch."),
         plan.describe_job(job))
        for job in plan.jobs
    ]


def plan_lines(plan: Plan) -> list[str]:
    """The plan as tab-separated lines (tensor, shape, dtype, operation), for pipes and grep."""
    return ["\t".join(row) for row in _plan_rows(plan, "x")]


def plan_table(plan: Plan) -> Table:
    """Every output tensor in write order with its shape, dtype and how it is made."""
    table = Table(
        title=f"plan: {len(plan.jobs)} tensors, {human_bytes(plan.total_bytes)}, "
        f"inputs: {escape(', '.join(plan.labels))}",
        title_justify="left",
    )
    table.add_column("tensor", overflow="fold")
    table.add_column("shape")
    table.add_column("dtype")
    table.add_column("operation", overflow="fold")
    for row in _plan_rows(plan, "×"):
        table.add_row(*map(escape, row))  # names and paths are the user's, not markup
    return table
