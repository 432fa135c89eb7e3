"""What a token router's ridge fit needs, kept so that `moemerge extend` can refit it with more
experts without the old calibration text (docs/extend.md).

Per layer, for the fitted rows and the held-out rows apart (λ is chosen on the held-out ones):
XᵀX [H, H], XᵀY [H, E] and YᵀY [E, E] with the targets Y *not* centred, and the row count,
all float64. The fit centres the targets, Y_c = Y C with C = I − 11ᵀ/E, so its equations are
XᵀY_c = XᵀY C and ‖Y_c‖² = tr(C YᵀY C): stored uncentred, they stay valid when E grows (an old
row's target for a new expert is 0, a zero column appended) and are re-centred for the new E.
The decisive scale (ridge.decisive_scale) needs the rows' logits under the new W, which no
moment gives: up to SAMPLE_ROWS router inputs [S, H] fp32 are kept (all of them when there are
no more; else evenly spread, each standing for `sample_weight` rows), with their targets [S, E]
(a fitted scale, `confidence: fit`, is fitted to them; files from before they were kept lack
them).
Size per layer: 2·H²·8 bytes for the Grams (64 MiB at H = 2048) plus the sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from moemerge.routing.ridge import (
    NormalEquations,
    decisive_scale,
    fitted_scale,
    normal_equations,
    solve_equations,
)

STATS_FILE = "router_stats.safetensors"
FORMAT = "moemerge-router-stats-1"
SAMPLE_ROWS = 4096


@dataclass
class Moments:
    """XᵀX [H, H], XᵀY [H, E], YᵀY [E, E] (targets uncentred) and the row count."""

    gram: torch.Tensor
    cross: torch.Tensor
    targets: torch.Tensor
    count: int

    @classmethod
    def of(cls, x: torch.Tensor, y: torch.Tensor) -> Moments:
        eq = normal_equations(x, y)
        y64 = y.double()
        return cls(eq.gram, eq.cross, y64.T @ y64, int(x.shape[0]))

    def __add__(self, other: Moments) -> Moments:
        return Moments(self.gram + other.gram, self.cross + other.cross,
                       self.targets + other.targets, self.count + other.count)

    def padded(self, experts: int) -> Moments:
        """The same rows with targets of `experts` columns, the new ones 0."""
        grow = experts - self.cross.shape[1]
        targets = torch.nn.functional.pad(self.targets, (0, grow, 0, grow))
        return Moments(self.gram, torch.nn.functional.pad(self.cross, (0, grow)), targets,
                       self.count)

    def centred(self) -> NormalEquations:
        n = self.cross.shape[1]
        c = torch.eye(n, dtype=torch.float64) - 1.0 / n  # C: subtracts each row's mean
        return NormalEquations(self.gram, self.cross @ c, float(torch.trace(c @ self.targets @ c)))


@dataclass
class LayerStatistics:
    fit: Moments  # rows not held out
    held_out: Moments
    sample: torch.Tensor  # [S, H] fp32 router inputs, for the scale
    sample_weight: torch.Tensor  # [S] rows each sample row stands for
    sample_targets: torch.Tensor | None  # [S, E] their targets (None: an older file)

    @property
    def experts(self) -> int:
        return self.fit.cross.shape[1]

    def __add__(self, other: LayerStatistics) -> LayerStatistics:
        """Both sets of rows (same expert count), the sample thinned to SAMPLE_ROWS."""
        sample = torch.cat([self.sample, other.sample])
        weight = torch.cat([self.sample_weight, other.sample_weight])
        targets = None
        if self.sample_targets is not None and other.sample_targets is not None:
            targets = torch.cat([self.sample_targets, other.sample_targets])
        if sample.shape[0] > SAMPLE_ROWS:
            keep = evenly_spread(sample.shape[0], SAMPLE_ROWS)
            weight = weight[keep] * (weight.sum() / weight[keep].sum())
            sample = sample[keep]
            targets = None if targets is None else targets[keep]
        return LayerStatistics(self.fit + other.fit, self.held_out + other.held_out,
                               sample, weight, targets)

    def padded(self, experts: int) -> LayerStatistics:
        targets = self.sample_targets
        if targets is not None:
            targets = torch.nn.functional.pad(targets, (0, experts - targets.shape[1]))
        return LayerStatistics(self.fit.padded(experts), self.held_out.padded(experts),
                               self.sample, self.sample_weight, targets)


def evenly_spread(n: int, count: int) -> torch.Tensor:
    return torch.linspace(0, n - 1, count).round().long()


def layer_statistics(x: torch.Tensor, y: torch.Tensor, held_out: torch.Tensor
                     ) -> LayerStatistics:
    """x [N, H] router inputs, y [N, E] uncentred targets, held_out [N] bool."""
    keep = evenly_spread(x.shape[0], SAMPLE_ROWS) if x.shape[0] > SAMPLE_ROWS else None
    sample, targets = (x, y) if keep is None else (x[keep], y[keep])
    weight = torch.full((sample.shape[0],), x.shape[0] / sample.shape[0], dtype=torch.float64)
    return LayerStatistics(Moments.of(x[~held_out], y[~held_out]),
                           Moments.of(x[held_out], y[held_out]), sample.float().clone(), weight,
                           targets.float().clone())


def refit(stats: LayerStatistics, confidence: float | str) -> torch.Tensor:
    """The router [E, H] fp32 ridge.fit_router and calibrate._solve give on the same rows (with
    `confidence: fit`, the scale fitted to the kept sample's targets through the refitted W:
    the build fits it on held-out windows through a W fitted without them, so the two differ
    slightly)."""
    both = stats.fit.count and stats.held_out.count
    fit = stats.fit.centred() if both else (stats.fit + stats.held_out).centred()
    w, _ = solve_equations(fit, stats.held_out.centred() if both else None)
    whole = bool((stats.sample_weight == 1).all())  # every row kept: the build's exact mean
    weights = None if whole else stats.sample_weight
    logits = stats.sample.double() @ w.T
    if confidence != "fit":
        return (w * decisive_scale(logits, confidence, weights=weights)).float()
    if stats.sample_targets is None:
        raise ValueError("calibration.confidence: fit needs the targets of the kept router "
                         "inputs, which this statistics file (from an older moemerge) lacks; "
                         "rebuild the model, or extend it with a number for the confidence")
    return (w * fitted_scale(logits, stats.sample_targets, weights=weights)).float()


def save_statistics(path: Path, layers: dict[int, LayerStatistics], windows: int) -> None:
    """One safetensors file: `layers.{l}.{fit|held_out}.{gram|cross|targets|count}`,
    `layers.{l}.sample`, `.sample_weight`, `.sample_targets`, and `windows` (calibration
    windows seen: new windows are numbered after them, so the same ones are held out as in a
    rebuild)."""
    from safetensors.torch import save_file

    tensors = {"windows": torch.tensor([windows])}
    for layer, stats in layers.items():
        for split in ("fit", "held_out"):
            m: Moments = getattr(stats, split)
            prefix = f"layers.{layer}.{split}"
            tensors.update({f"{prefix}.gram": m.gram, f"{prefix}.cross": m.cross,
                            f"{prefix}.targets": m.targets,
                            f"{prefix}.count": torch.tensor([m.count])})
        tensors[f"layers.{layer}.sample"] = stats.sample.contiguous()
        tensors[f"layers.{layer}.sample_weight"] = stats.sample_weight
        if stats.sample_targets is not None:
            tensors[f"layers.{layer}.sample_targets"] = stats.sample_targets.contiguous()
    save_file(tensors, str(path), metadata={"format": FORMAT})


def load_statistics(path: Path) -> tuple[dict[int, LayerStatistics], int]:
    """({layer: statistics}, windows) as save_statistics wrote them; ValueError if the file is
    not one."""
    with safe_open(str(path), framework="pt") as f:
        if (f.metadata() or {}).get("format") != FORMAT:
            raise ValueError(f"{path.name} is not a {FORMAT} file")
        t = {name: f.get_tensor(name) for name in f.keys()}

    def moments(prefix: str) -> Moments:
        return Moments(t[f"{prefix}.gram"], t[f"{prefix}.cross"], t[f"{prefix}.targets"],
                       int(t[f"{prefix}.count"][0]))

    layers = sorted({int(name.split(".")[1]) for name in t if name.startswith("layers.")})
    return ({layer: LayerStatistics(moments(f"layers.{layer}.fit"),
                                    moments(f"layers.{layer}.held_out"),
                                    t[f"layers.{layer}.sample"],
                                    t[f"layers.{layer}.sample_weight"],
                                    t.get(f"layers.{layer}.sample_targets"))
             for layer in layers},
            int(t["windows"][0]))


STATS_NOTE = f"# router statistics: {STATS_FILE} (for `moemerge extend`)\n"


def keep_statistics(model_dir: Path, layers: dict[int, LayerStatistics], windows: int) -> None:
    """Write the statistics file into a model being built and name it in its recipe copy (a
    YAML comment: the recipe parses, and rebuilds, as before)."""
    from moemerge.io.atomic import RECIPE_COPY

    save_statistics(model_dir / STATS_FILE, layers, windows)
    copy = model_dir / RECIPE_COPY
    copy.write_text(copy.read_text() + ("" if copy.read_text().endswith("\n") else "\n")
                    + STATS_NOTE)
