"""Terminal renderings of moemerge objects (rich tables)."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table
from rich.text import Text

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


def plan_table(plan: Plan) -> PlanView:
    """Every output tensor in write order with its shape, dtype and how it is made."""
    return PlanView(plan)


class PlanView:
    """The plan for the console it is printed on: a table (tensor, shape, dtype, operation)
    when it fits whole, else one tensor per line with its shape, dtype and operation indented
    on the next, so no tensor name is broken across lines or cut."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.title = (f"plan: {len(plan.jobs)} tensors, {human_bytes(plan.total_bytes)}, "
                      f"inputs: {', '.join(plan.labels)}")
        self.rows = _plan_rows(plan, "×")

    def __rich_console__(self, console, options):
        widths = [max([len(h), *(len(r[i]) for r in self.rows)])
                  for i, h in enumerate(("tensor", "shape", "dtype", "operation"))]
        if sum(widths) + 3 * len(widths) + 1 <= options.max_width:
            table = Table(title=escape(self.title), title_justify="left")
            for header, width in zip(("tensor", "shape", "dtype", "operation"), widths,
                                     strict=True):
                table.add_column(header, width=width)
            for row in self.rows:
                table.add_row(*map(escape, row))  # names and paths are the user's, not markup
            yield table
            return
        yield Text(self.title, style="italic")
        shape, dtype = widths[1], widths[2]
        for tensor, *details in self.rows:
            yield Text(tensor, style="bold")
            yield Text(f"    {details[0]:<{shape}}  {details[1]:<{dtype}}  {details[2]}")
