"""`merge`: cluster a layer's experts into K groups and average each group (HC-SMoE's way).

Clustering: agglomerative with average linkage on the cosine distance 1 − cos(o_e, o_f) of the
experts' outputs on the same calibration tokens (HC-SMoE, Chen et al. 2024, found outputs the
best similarity and average linkage the best linkage). Ties merge the pair of lowest indices,
so the result is deterministic.

Each group's expert is the saliency-weighted average (REAP or frequency, per `--saliency`) of
its members' gate / up / down weights: the expert the router sent most of the group's work to
counts most. A group that no token chose is a plain mean.

Its router row is the frequency-weighted mean of the members' rows. Why the mean and not a sum
or a logsumexp: the exact merged logit would be log Σ exp(r_e · x), which no linear row
computes; when the members' rows are equal, the mean row is that row, so a group of identical
experts with identical rows is routed exactly as each was with top-1 routing (with top-k ≥ 2
the originals could fill two slots with the same expert, which one expert cannot: there no
row is exact, and router repair fits what routing it can). Frequency weights: the group is
routed like the member the router chose most often.
"""

from __future__ import annotations

import torch

from moemerge.built.shrink.prune import Grouping, saliency_of
from moemerge.built.shrink.stats import LayerStats


def cluster(similarity: torch.Tensor, kept: int) -> list[list[int]]:
    """[E, E] cosine similarity -> `kept` groups of expert indices (average linkage), each
    ascending, ordered by their lowest index."""
    distance = (1.0 - similarity.double()).tolist()
    groups = [[e] for e in range(len(distance))]
    while len(groups) > kept:
        best = None
        for a in range(len(groups)):
            for b in range(a + 1, len(groups)):
                link = sum(distance[i][j] for i in groups[a] for j in groups[b]) / (
                    len(groups[a]) * len(groups[b]))
                if best is None or link < best[0] - 1e-12:
                    best = (link, a, b)
        _, a, b = best
        groups[a] = sorted(groups[a] + groups[b])
        del groups[b]
    return sorted(groups)


def normalised(values: list[float]) -> list[float]:
    """Weights summing to 1; all zero (no token chose any member): equal weights."""
    total = sum(values)
    return [v / total for v in values] if total > 0 else [1.0 / len(values)] * len(values)


def merge(stats: LayerStats, kept: int, saliency: str) -> Grouping:
    groups = cluster(stats.similarity, kept)
    score = saliency_of(stats, saliency).tolist()
    frequency = stats.frequency.tolist()
    return Grouping(groups,
                    [normalised([score[e] for e in g]) if len(g) > 1 else [1.0] for g in groups],
                    [normalised([frequency[e] for e in g]) if len(g) > 1 else [1.0]
                     for g in groups],
                    [])
