"""Renderings of a RoutingReport: rich tables (mean over layers; per layer) and a PNG."""

from __future__ import annotations

from pathlib import Path

from rich.markup import escape

from moemerge.analysis.routing import RoutingReport
from moemerge.eval.perplexity import windows_note
from moemerge.terminal_tables import Column, Fitted
from moemerge.words import plural


def _shares(values: list[float]) -> list[str]:
    """Percentages, the largest in bold (the expert this domain's tokens go to most)."""
    top = max(values)
    return [f"[bold]{v:.1%}[/]" if v == top else f"{v:.1%}" for v in values]


def _measure(report: RoutingReport) -> str:
    """What a share is: of top-k slots, or (merged experts) of the routing weight."""
    return "mean routing weight" if report.level == "weight" else f"share of {report.level} slots"


def _describe(report: RoutingReport, what: str = "") -> str:
    n = len(report.labels)
    used = ("every token mixes all" if report.level == "weight"
            else f"top-{report.experts_per_token}")
    return f"{_measure(report)} per expert{what} ({used} of {n}; uniform = {1 / n:.1%})"


def _title(report: RoutingReport, what: str) -> str:
    return f"routing: {_describe(report, what)}"


def _layered(report: RoutingReport) -> bool:
    return report.level != "sequence"  # token and weight levels have a row per layer


def _units(report: RoutingReport) -> str:
    return "sequences" if report.level == "sequence" else "tokens"


def _experts(report: RoutingReport) -> list[Column]:
    return [Column(label, short=f"E{i + 1}") for i, label in enumerate(report.labels)]


def summary_table(report: RoutingReport) -> Fitted:
    """Rows = domains; columns = each expert's share averaged over layers, tokens, perplexity
    (as many tables as the console's width needs, none cutting a number)."""
    over = f", mean over {plural(len(report.layers), 'layer')}" if _layered(report) else ""
    columns = [Column("domain", "left", key=True), *_experts(report),
               Column(_units(report)), Column("perplexity")]
    rows = [[escape(name), *_shares(d.mean_share), str(d.tokens), f"{d.perplexity:.2f}"]
            for name, d in report.domains.items()]
    caption = None
    if report.windows:
        caption = windows_note(report.windows["count"], seq_len=report.windows["seq_len"],
                               max_tokens=report.windows["max_tokens"])
    return Fitted(columns, rows, title=_title(report, over), caption=caption)


def layer_table(report: RoutingReport) -> Fitted:
    """Rows = (domain, layer); columns = each expert's share in that layer."""
    columns = [Column("domain", "left", key=True), Column("layer", key=True), *_experts(report)]
    rows = [[escape(name), str(layer), *_shares(row)] for name, d in report.domains.items()
            for layer, row in zip(report.layers, d.share, strict=True)]
    return Fitted(columns, rows, title=_title(report, ", per layer"))


def plot(report: RoutingReport, path: Path) -> None:
    """The routing figure (`figure`) as a PNG."""
    figure(report).savefig(path, dpi=120)


def figure(report: RoutingReport):
    """Left: grouped bars of each domain's mean share per expert (as MergeME's Fig. 5), with
    the uniform share dashed, the domains' legend beside them (inside, it hid a bar). Then one
    heatmap per domain: rows layers, columns experts."""
    from matplotlib.figure import Figure  # no pyplot: no global backend; PNG goes through Agg

    labels, layers, domains = report.labels, report.layers, list(report.domains)
    n = len(labels)
    fig = Figure(figsize=(3.5 + 0.5 * n + len(domains) * (1.2 + 0.45 * n),
                          2.6 + 0.22 * len(layers)), layout="constrained")
    axes = fig.subplots(1, 1 + len(domains), squeeze=False,
                        width_ratios=[1.5 + 0.4 * n] + [0.8 + 0.45 * n] * len(domains))[0]
    bars = axes[0]
    width = 0.8 / max(1, len(domains))
    for i, name in enumerate(domains):
        xs = [e - 0.4 + width * (i + 0.5) for e in range(n)]
        bars.bar(xs, report.domains[name].mean_share, width, label=name)
    bars.axhline(1 / n, color="grey", linestyle="--", linewidth=0.8)
    bars.set_xticks(range(n), labels, rotation=45, ha="right", fontsize=7)
    bars.set_xlabel("expert", fontsize=8)
    bars.set_ylabel(_measure(report) + (" (mean over layers)" if _layered(report) else ""),
                    fontsize=8)
    bars.legend(fontsize=7, title="domain", title_fontsize=7, loc="upper left",
                bbox_to_anchor=(1.0, 1.0))  # outside the axes: it covers no bar
    image = None
    for ax, name in zip(axes[1:], domains, strict=True):
        grid = report.domains[name].share  # [layer, expert]
        image = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_title(name, fontsize=8)
        ax.set_xticks(range(n), labels, rotation=45, ha="right", fontsize=7)
        rows = [str(layer) for layer in layers] if _layered(report) else ["sequence"]
        ax.set_yticks(range(len(layers)), rows, fontsize=7)
        if len(layers) * n <= 150:  # annotate only while the numbers stay legible
            for y, row in enumerate(grid):
                for x, value in enumerate(row):
                    ax.text(x, y, f"{value:.0%}", ha="center", va="center", fontsize=6,
                            color="black" if value > 0.6 else "white")
    if domains:
        axes[1].set_ylabel("layer" if _layered(report) else "", fontsize=8)
        fig.colorbar(image, ax=list(axes[1:]), label=_measure(report), shrink=0.9)
    fig.suptitle(f"{_describe(report)} — {report.model}", fontsize=8)
    return fig
