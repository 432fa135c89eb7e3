"""`inspect routing --plot`: the domains' legend sits beside the bars, covering none of them
(inside the axes it hid the last expert's bars) and no heatmap."""

from matplotlib.backends.backend_agg import FigureCanvasAgg

from moemerge.analysis.routing import DomainRouting, RoutingReport
from moemerge.analysis.routing_render import figure


def test_the_legend_covers_no_bar_and_no_heatmap():
    shares = {"code": [[0.9, 0.05, 0.05], [0.85, 0.1, 0.05]],
              "prose": [[0.1, 0.8, 0.1], [0.1, 0.85, 0.05]],
              "math": [[0.05, 0.1, 0.85], [0.1, 0.05, 0.85]]}  # tall bars on the right
    report = RoutingReport("toy-moe", 2, ["code", "prose", "math"], [0, 1],
                           {d: DomainRouting(100, 5.0, s) for d, s in shares.items()})
    fig = figure(report)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    bars, *heatmaps = fig.axes[:1 + len(shares)]
    legend = bars.get_legend().get_window_extent(renderer)
    covered = [p for p in bars.patches if p.get_window_extent(renderer).overlaps(legend)]
    assert not covered, f"the legend covers {len(covered)} bars"
    assert not legend.overlaps(bars.get_window_extent(renderer))
    assert not any(legend.overlaps(ax.get_window_extent(renderer)) for ax in heatmaps)
