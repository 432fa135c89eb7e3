"""Least squares from row blocks: the bridged projectors' fit at any vocabulary size.

min_X ‖S X − O‖ over V rows (S [V, d_m], O [V, d_o]) through the normal equations
SᵀS X = SᵀO, accumulated in float64 block by block: memory is the two accumulators
([d_m, d_m] and [d_m, d_o]) and one block of rows, not a float64 copy of S and O (at a
151936 × 4096 embedding those would be 5 GB each). Squaring the condition number costs little
in float64 for embedding matrices, whose columns are far from collinear.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

ROWS_PER_BLOCK = 8192


def padded_average_fit(sources: Sequence[Tensor], weights: Sequence[float] | None, own: Tensor,
                       width: int, *, rows: int = ROWS_PER_BLOCK) -> Tensor:
    """X [width, d_o] minimising ‖S X − own‖, with S the weighted average of `sources`
    ([V, d_i] each) zero-padded to `width` columns: S = Σ_i w_i pad(source_i) / Σ_i w_i."""
    w = torch.tensor(list(weights) if weights else [1.0] * len(sources), dtype=torch.float64)
    w = w / w.sum()
    gram = torch.zeros(width, width, dtype=torch.float64)  # SᵀS
    cross = torch.zeros(width, own.shape[1], dtype=torch.float64)  # SᵀO
    for start in range(0, own.shape[0], rows):
        stop = min(start + rows, own.shape[0])
        block = torch.zeros(stop - start, width, dtype=torch.float64)  # rows of S
        for w_i, source in zip(w.tolist(), sources, strict=True):
            block[:, : source.shape[1]].add_(source[start:stop].double(), alpha=w_i)
        gram.addmm_(block.T, block)
        cross.addmm_(block.T, own[start:stop].double())
    # gelsd (SVD): the same bytes in every process; the default gelsy (pivoted QR) was not,
    # ~1e-15 apart between runs of one build (tests/merge/test_least_squares.py). Both give
    # the minimum-norm solution where zero-padded columns make the Gram matrix singular.
    return torch.linalg.lstsq(gram, cross, driver="gelsd").solution
