"""What each new expert of a layer is: a `Grouping`, and `prune`'s choice of one.

A layer of E experts becomes K: new expert j is the weighted average of the old experts
groups[j] with weights[j] (summing to 1); its router row is the average of their rows with
row_weights[j]. Pruning makes every group one expert (weight 1: a plain copy); merge.py makes
larger groups. New experts keep the order of their lowest old index, so keeping every expert
changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moemerge.built.shrink.stats import LayerStats


@dataclass
class Grouping:
    groups: list[list[int]]  # [K] old expert indices of each new expert, ascending
    weights: list[list[float]]  # [K] the expert-weight average's weights per group
    row_weights: list[list[float]]  # [K] the router-row average's weights per group
    removed: list[int]  # old experts not in any group (prune)

    @property
    def kept(self) -> int:
        return len(self.groups)

    def matrix(self, num_experts: int, rows: bool = False) -> torch.Tensor:
        """[K, E] float64: new = matrix @ old, along the expert axis."""
        out = torch.zeros(self.kept, num_experts, dtype=torch.float64)
        for j, (group, weights) in enumerate(zip(self.groups,
                                                 self.row_weights if rows else self.weights,
                                                 strict=True)):
            out[j, group] = torch.tensor(weights, dtype=torch.float64)
        return out


def saliency_of(stats: LayerStats, saliency: str) -> torch.Tensor:
    """[E] the score `saliency` names: reap or frequency."""
    return stats.reap if saliency == "reap" else stats.frequency


def prune(stats: LayerStats, kept: int, saliency: str) -> Grouping:
    """Keep the `kept` experts of highest saliency (ties: the lower index), in index order."""
    score = saliency_of(stats, saliency).tolist()
    order = sorted(range(len(score)), key=lambda e: (-score[e], e))
    keep = sorted(order[:kept])
    return Grouping([[e] for e in keep], [[1.0] for _ in keep], [[1.0] for _ in keep],
                    sorted(order[kept:]))
