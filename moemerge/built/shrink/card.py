"""What a shrink leaves beside the weights: shrink.json (per layer, what was kept, removed or
merged, and the statistics behind it) and a README.md that says it in words."""

from __future__ import annotations

import json
from pathlib import Path

from moemerge.built.shrink.prune import Grouping
from moemerge.built.shrink.stats import LayerStats
from moemerge.recipe.shrink import ShrinkRecipe

SCHEMA = "moemerge.shrink/1"  # bump when a key changes meaning or disappears (docs/shrink.md)
SHRINK_FILE = "shrink.json"


def _rounded(values) -> list[float]:
    return [round(float(v), 6) for v in values]


def shrink_json(moe: Path, recipe: ShrinkRecipe, before: int, groupings: dict[int, Grouping],
                stats: dict[int, LayerStats], tokens: int, notes: list[str]) -> str:
    layers = []
    for layer, grouping in groupings.items():
        s = stats[layer]
        layers.append({
            "layer": layer, "groups": grouping.groups,
            "weights": [_rounded(w) for w in grouping.weights],
            "router_row_weights": [_rounded(w) for w in grouping.row_weights],
            "removed": grouping.removed, "frequency": _rounded(s.frequency),
            "reap": _rounded(s.reap),
            **({"similarity": [_rounded(r) for r in s.similarity]}
               if recipe.method == "merge" else {}),
        })
    return json.dumps({
        "schema": SCHEMA, "model": str(moe), "method": recipe.method,
        "saliency": recipe.saliency, **({"merge_method": recipe.merge_method}
                                         if recipe.method == "merge" else {}),
        "repair": recipe.repair, "experts_before": before,
        "experts_after": next(iter(groupings.values())).kept if groupings else before,
        "calibration_tokens": tokens, "notes": notes, "layers": layers,
    }, indent=1) + "\n"


def readme(moe: Path, recipe: ShrinkRecipe, before: int, kept: int,
           groupings: dict[int, Grouping], notes: list[str]) -> str:
    how = ("the most salient experts of each layer kept" if recipe.method == "prune" else
           "each layer's experts clustered by the similarity of their outputs and each "
           f"cluster merged into one ({recipe.merge_method})")
    lines = [f"# {moe.name}, shrunk to {kept} of {before} experts per layer", "",
             f"Written by `moemerge shrink` from `{moe}`: {how} (saliency: {recipe.saliency}; "
             f"router repair: {'on' if recipe.repair else 'off'}). `shrink.json` holds, per "
             "layer, the groups, the weights, and the routing frequency and REAP saliency of "
             "every original expert on the calibration text; `moemerge_recipe.yaml` rebuilds "
             "it with `moemerge build` (docs/shrink.md).", "", "| layer | kept / merged |",
             "|---:|---|"]
    for layer, grouping in groupings.items():
        lines.append(f"| {layer} | " + ", ".join("+".join(map(str, g))
                                                 for g in grouping.groups) + " |")
    lines += ["", *(f"- {note}" for note in notes)]
    return "\n".join(lines).rstrip() + "\n"
