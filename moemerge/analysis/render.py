"""Renderings of a TaskVectorReport: rich tables, markdown, the JSON dict, a PNG heatmap."""

from __future__ import annotations

import math
from pathlib import Path

from rich.markup import escape

from moemerge.analysis.task_vectors import GroupResult, TaskVectorReport
from moemerge.analysis.verdict import verdict
from moemerge.io.resolve import looks_like_path
from moemerge.terminal_tables import Column, Fitted

SCHEMA = "moemerge.inspect/1"  # bump when a key changes meaning or disappears (docs/inspect.md)


def _num(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) else x


def _group_dict(g: GroupResult, names: list[str]) -> dict:
    return {
        "role": g.role,
        "layer": g.layer,
        "numel": g.numel,
        "mean_cosine": g.mean_cosine(),
        "min_cosine": g.min_cosine(),
        "pairs": [
            {"a": names[i], "b": names[j], "cosine": _num(g.cosine[i][j]),
             "sign_conflict": _num(g.sign_conflict[i][j])}
            for i, j in g.pairs()
        ],
        "experts": [
            {"name": name, "relative_norm": _num(g.relative_norm[i]),
             "ties_trimmed_mass": _num(g.ties_trimmed_mass[i])}
            for i, name in enumerate(names)
        ],
        "all_sign_conflict": _num(g.all_sign_conflict),
    }


def to_dict(report: TaskVectorReport) -> dict:
    """The `--json` document; NaN (undefined, e.g. an expert that did not move) becomes null."""
    names = report.names
    return {
        "schema": SCHEMA,
        "base": {"name": report.base[0], "path": report.base[1]},
        "experts": [{"name": n, "path": p} for n, p in report.experts],
        "density": report.density,
        "groups": [_group_dict(g, names) for g in report.groups],
        "summary": {role: _group_dict(g, names) for role, g in report.summary.items()},
        "verdict": verdict(report),
    }


def _signed(x: float) -> str:
    return f"{round(x, 2) + 0.0:+.2f}"  # + 0.0: no "-0.00"


def _fmt(x: float | None, kind: str) -> str:
    if x is None or math.isnan(x):
        return "—"
    return {"cos": _signed(x), "pct": f"{x:.0%}", "norm": f"{x:#.3g}"}[kind]


def _rows(report: TaskVectorReport, groups: list[GroupResult], summary: bool) -> tuple:
    """(header, rows) shared by the rich and markdown tables."""
    names = report.names
    header = ["role"] + ([] if summary else ["layer"])
    header += ["mean cos", "min cos", "sign conflict", "all-sign conflict"]
    header += [f"‖τ‖/‖W‖ {n}" for n in names]
    if summary:
        header.append(f"TIES-trimmed mass @{report.density:g}")
    rows = []
    for g in groups:
        row = [g.role] + ([] if summary else ["global" if g.layer is None else str(g.layer)])
        row += [_fmt(g.mean_cosine(), "cos"), _fmt(g.min_cosine(), "cos"),
                _fmt(g.mean_sign_conflict(), "pct"), _fmt(g.all_sign_conflict, "pct")]
        row += [_fmt(x, "norm") for x in g.relative_norm]
        if summary:
            row.append(" / ".join(_fmt(x, "pct") for x in g.ties_trimmed_mass))
        rows.append(row)
    return header, rows


def _layer(g: GroupResult) -> str:
    return "global" if g.layer is None else str(g.layer)


def tables(report: TaskVectorReport) -> list[Fitted]:
    """The terminal's tables, each fitting the console without cutting a number: per layer
    and per role, how the experts' task vectors relate, then each expert's ‖τ‖/‖W‖ (per role
    with its TIES-trimmed mass). An expert column that does not fit goes to a further table;
    a long expert name is shown as E1, E2, ... with a legend. `--markdown` has the same values
    in the wide tables of `_rows`."""
    experts = [Column(name, short=f"E{i + 1}") for i, name in enumerate(report.names)]
    pair_stats = [Column(h) for h in ("mean cos", "min cos", "sign conflict",
                                      "all-sign conflict")]
    role, layer = Column("role", "left", key=True), Column("layer", "left", key=True)
    per_layer, per_role = report.groups, list(report.summary.values())

    def pairs(g: GroupResult) -> list[str]:
        return [_fmt(g.mean_cosine(), "cos"), _fmt(g.min_cosine(), "cos"),
                _fmt(g.mean_sign_conflict(), "pct"), _fmt(g.all_sign_conflict, "pct")]

    def norm_and_mass(g: GroupResult) -> list[str]:
        return [f"{_fmt(n, 'norm')} ({_fmt(m, 'pct')})"
                for n, m in zip(g.relative_norm, g.ties_trimmed_mass, strict=True)]

    layout = [
        ("task vectors per layer: between experts", [role, layer, *pair_stats],
         [[g.role, _layer(g), *pairs(g)] for g in per_layer]),
        ("task vectors per layer: ‖τ‖/‖W‖ of each expert", [role, layer, *experts],
         [[g.role, _layer(g), *(_fmt(x, "norm") for x in g.relative_norm)] for g in per_layer]),
        ("per role (all layers): between experts", [role, *pair_stats],
         [[g.role, *pairs(g)] for g in per_role]),
        (f"per role (all layers): ‖τ‖/‖W‖ of each expert (TIES-trimmed mass "
         f"@{report.density:g})", [role, *experts],
         [[g.role, *norm_and_mass(g)] for g in per_role]),
    ]
    return [Fitted(columns, [[escape(c) for c in row] for row in rows], title=title)
            for title, columns, rows in layout]


def public_name(ref: str) -> str:
    """What a model card may say of a model: a hub id as it is, a local path by its name only
    (no absolute path of the machine that wrote it)."""
    return Path(ref.rstrip("/")).name if looks_like_path(ref) or Path(ref).exists() else ref


def markdown(report: TaskVectorReport) -> str:
    """A model-card section: the summary and per-layer tables and the verdict."""
    expert_list = ", ".join(f"`{n}`" for n in report.names)
    lines = ["## Task vectors", "",
             f"Experts {expert_list} against base `{public_name(report.base[1])}` "
             "(τ = expert − base); "
             "statistics defined in moemerge's docs/inspect.md.", ""]
    for title, groups, summary in (("Per role", list(report.summary.values()), True),
                                   ("Per layer", report.groups, False)):
        header, rows = _rows(report, groups, summary)
        lines += [f"### {title}", "", "| " + " | ".join(header) + " |",
                  "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines.append("")
    lines += ["### Verdict", "", verdict(report), ""]
    return "\n".join(lines)


def plot(report: TaskVectorReport, path: Path) -> None:
    """Heatmaps, one panel per role: y = layers (global tensors on top), x = expert pairs,
    colour = cosine on a diverging colormap centred at 0; values written in when few cells."""
    from matplotlib.figure import Figure  # no pyplot: no global backend; PNG goes through Agg

    names = report.names
    roles = [r for r in report.summary if report.summary[r].pairs()]
    if not roles:
        raise ValueError("a cosine plot needs at least two experts")
    pairs = report.summary[roles[0]].pairs()
    xlabels = [f"{names[i]}–{names[j]}" for i, j in pairs]
    panels = [[g for g in report.groups if g.role == r] for r in roles]
    height = max(len(p) for p in panels)
    size = (1.5 + len(roles) * (1.0 + 0.7 * len(pairs)), 2.4 + 0.3 * height)
    fig = Figure(figsize=size, layout="constrained")  # makes room for rotated pair labels
    axes = fig.subplots(1, len(roles), squeeze=False)[0]
    image = None
    for ax, role, groups in zip(axes, roles, panels, strict=True):
        grid = [[g.cosine[i][j] for i, j in pairs] for g in groups]  # [layers, pairs]
        image = ax.imshow(grid, cmap="RdBu_r", vmin=-1.0, vmax=1.0, aspect="auto")
        ax.set_title(role)
        ax.set_xticks(range(len(pairs)), xlabels, rotation=45, ha="right", fontsize=7)
        ax.set_yticks(range(len(groups)),
                      ["global" if g.layer is None else str(g.layer) for g in groups], fontsize=7)
        if len(groups) * len(pairs) <= 150:  # annotate only while the numbers stay legible
            for y, row in enumerate(grid):
                for x, value in enumerate(row):
                    if not math.isnan(value):  # white on the dark ends of the colormap
                        ax.text(x, y, _signed(value), ha="center", va="center", fontsize=6,
                                color="white" if abs(value) > 0.6 else "black")
    axes[0].set_ylabel("layer")
    fig.colorbar(image, ax=list(axes), label="cosine of task vectors", shrink=0.9)
    fig.suptitle(f"task-vector cosine between experts (base {report.base[1]})", fontsize=8)
    fig.savefig(path, dpi=120)
