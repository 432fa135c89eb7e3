"""Merging a large tensor in row blocks, and the whole-tensor statistics that makes exact.

A merge of a [V, d] tensor in one piece holds several float32 copies of it per model (the
upcast inputs, the task vectors, their magnitudes, masks): at a 152k × 4096 embedding that is
gigabytes, and the arithmetic streams each copy through memory. In row blocks of about
`BLOCK_ELEMENTS` entries the working set is a few blocks that stay in cache, and the output is
written in its own dtype as it is made.

A method may run in blocks when every output entry depends only on the inputs at the same
place, given some statistics of the whole tensor computed first (TIES's and breadcrumbs'
magnitude thresholds, found here by an exact two-pass histogram select that streams over the
same blocks; the whole tensor's L1 factors of DARE's and DELLA's mergekit rescale, from the
drop made once more). The registry names, per method, the function that returns those
statistics (as extra keyword arguments for every block); a method without one runs whole.

Random methods draw each entry's mask from a hash of its place in the whole tensor
(merge/draws.py: each block gets the tensor's draws from its first entry on), so the bytes are
the same in any blocks, any order, any worker count, and as the tensor merged in one piece.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from moemerge import buffers
from moemerge.merge.draws import Draws, draws_or_default
from moemerge.merge.primitives import (
    PerModel,
    check_density,
    dare_drop,
    keep_count,
    l1_factor,
    per_model,
    task_vectors,
)
from moemerge.merge.sparse import magprune

BLOCK_ELEMENTS = 1 << 18  # 1 MiB per float32 block: a few of them per model stay in cache
_BUCKETS = 1 << 16  # the top 16 bits of a non-negative float32: exponent and 7 mantissa bits


def row_blocks(shape: Sequence[int], block: int = BLOCK_ELEMENTS) -> list[slice]:
    """Slices of whole rows (the first axis) of about `block` entries each; one slice covering
    everything for tensors of at most `block` entries or fewer than 2 dimensions."""
    numel = 1
    for n in shape:
        numel *= n
    if len(shape) < 2 or numel <= block:
        return [slice(None)]
    rows = max(1, block // max(1, numel // shape[0]))
    return [slice(r, min(r + rows, shape[0])) for r in range(0, shape[0], rows)]


Parts = Callable[[], Iterator[Tensor]]


def kth_largest(parts: Parts, k: int) -> Tensor:
    """The k-th largest value (1-based) of the non-negative float32 entries that `parts()`
    yields, exactly (the value `kthvalue` finds on all of them at once), in two passes:
    a histogram of the top 16 bits of each value's IEEE bits (monotone in the value), then
    `kthvalue` within the one bucket that holds the k-th largest. Memory: one part, the
    65536 counts and that bucket's entries."""
    counts, total = None, 0  # the counts live where the parts do (a GPU under --device cuda)
    for part in parts():
        keys = part.reshape(-1).view(torch.int32) >> 15  # int32: bincount is slower on int64
        hist = torch.bincount(keys, minlength=_BUCKETS)
        counts = hist if counts is None else counts.add_(hist)
        total += part.numel()
    if counts is None or not 1 <= k <= total:
        raise ValueError(f"k = {k} is outside 1..{total}")
    buckets, ranks = select_bins(counts[None], torch.tensor([k], device=counts.device))
    bucket, rank = int(buckets[0]), int(ranks[0])
    inside = torch.cat([p.reshape(-1)[(p.reshape(-1).view(torch.int32) >> 15) == bucket]
                        for p in parts()])
    return inside.kthvalue(inside.numel() - rank + 1).values


def select_bins(counts: Tensor, ks: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of `counts` [N, B] (a histogram over ordered bins), the bin holding the k-th
    largest entry and that entry's rank (1-based, from the top) within the bin: ([N], [N])."""
    above = counts.flip(1).cumsum(1).flip(1)  # above[i, b]: row i's entries in bins >= b
    bins = (above >= ks[:, None]).sum(1) - 1  # non-increasing: the last bin reaching k
    after = torch.cat([above, torch.zeros_like(above[:, :1])], 1).gather(1, bins[:, None] + 1)
    return bins, ks - after[:, 0]


def _magnitudes(base: Tensor, tensor: Tensor, blocks: list[slice]) -> Parts:
    """|τ| = |θ − θ_base| block by block, in float32."""
    return lambda: ((tensor[b].float() - base[b].float()).abs_() for b in blocks)


def elementwise(base: Tensor | None, tensors: Sequence[Tensor], blocks: list[slice],
                **params) -> dict:
    """Methods with no whole-tensor statistic: every block merges alone."""
    return {}


def dare_l1(base: Tensor, tensors: Sequence[Tensor], blocks: list[slice], *,
            density: PerModel, rescale: str = "expectation", draws: Draws | None = None,
            **params) -> dict:
    """DARE's L1 rescale (mergekit's) in row blocks: each model's factor |τ|₁ / |kept|₁ over
    the whole tensor, from the masks the merge will draw; nothing for the other rescales."""
    if rescale != "l1":
        return {}
    densities = per_model(density, len(tensors))
    return {"l1_scale": _l1_scales(base, tensors, blocks, draws,
                                   lambda tau, i, d: dare_drop(tau, densities[i], d, i, "none"))}


def della_l1(base: Tensor, tensors: Sequence[Tensor], blocks: list[slice], *,
             density: PerModel, epsilon: PerModel, rescale: str = "expectation",
             draws: Draws | None = None, **params) -> dict:
    """dare_l1 for DELLA's MagPrune."""
    if rescale != "l1":
        return {}
    densities, epsilons = per_model(density, len(tensors)), per_model(epsilon, len(tensors))
    return {"l1_scale": _l1_scales(
        base, tensors, blocks, draws,
        lambda tau, i, d: magprune(tau, densities[i], epsilons[i], d, i, "none"))}


def _l1_scales(base: Tensor, tensors: Sequence[Tensor], blocks: list[slice],
               draws: Draws | None, drop: Callable[[Tensor, int, Draws], Tensor]) -> Tensor:
    """[N] L1 factors of a random drop over the whole tensor (primitives.l1_factor), from the
    masks the merge will draw (each entry's draw depends on its place alone). Norms summed in
    float64 over the blocks."""
    n, draws = len(tensors), draws_or_default(draws)
    before = torch.zeros(n, dtype=torch.float64, device=base.device)
    after = torch.zeros_like(before)
    for b in blocks:
        at = draws.at(first_entry(b, base.shape))
        for i, tau in enumerate(task_vectors(base[b], [t[b] for t in tensors])):
            before[i] += tau.abs().sum(dtype=torch.float64)
            after[i] += drop(tau, i, at).abs().sum(dtype=torch.float64)
    return l1_factor(before.float(), after.float())


def first_entry(block: slice, shape: Sequence[int]) -> int:
    """The flat index of a row block's first entry in a tensor of `shape`."""
    return 0 if block.start is None else block.start * math.prod(shape[1:])


def trim_thresholds(base: Tensor, tensors: Sequence[Tensor], blocks: list[slice], *,
                    density: PerModel, trim_rounding: str = "ceil", **params) -> dict:
    """TIES's per-model cut-offs: the k-th largest |τ_i| over the whole tensor, k =
    keep_count(n, density_i); 0 for a model at density 1 (it keeps everything); [N] float32,
    or nothing to pass when every density is 1."""
    densities = per_model(density, len(tensors))
    for d in densities:
        check_density(d)
    n = base.numel()
    if all(d == 1.0 for d in densities) or n == 0:
        return {}
    return {"thresholds": torch.stack([
        kth_largest(_magnitudes(base, t, blocks), keep_count(n, d, trim_rounding))
        if d < 1.0 else torch.zeros((), device=base.device)
        for t, d in zip(tensors, densities, strict=True)])}


def outlier_thresholds(base: Tensor, tensors: Sequence[Tensor], blocks: list[slice], *,
                       density: PerModel, gamma: PerModel, trim_rounding: str = "ceil",
                       **params) -> dict:
    """Breadcrumbs' per-model band [low, high] of kept magnitudes (sparse.trim_outliers);
    [0, inf] for a model at density 1."""
    densities, gammas = per_model(density, len(tensors)), per_model(gamma, len(tensors))
    for d in densities:
        check_density(d)
    n = base.numel()
    if all(d == 1.0 for d in densities) or n == 0:
        return {}
    bands = []
    for t, d, g in zip(tensors, densities, gammas, strict=True):
        if d == 1.0:
            bands.append((0.0, float("inf")))
            continue
        parts = _magnitudes(base, t, blocks)
        keep = keep_count(n, d, trim_rounding)
        bottom = max(0, n - keep - int(g * n))
        bands.append((kth_largest(parts, n - bottom), kth_largest(parts, n - bottom - keep + 1)))
    return {"bands": torch.tensor(bands, dtype=torch.float32)}  # [N, 2]: low, high


def merge_in_blocks(function: Callable[..., Tensor], base: Tensor | None,
                    tensors: Sequence[Tensor], blocks: list[slice], dtype: torch.dtype,
                    pass_base: bool, **kwargs) -> Tensor:
    """`function` applied to each row block of the inputs, written into one tensor of `dtype`
    (the cast of a block is the cast of those entries of the whole)."""
    out = buffers.empty(tensors[0].shape, dtype)
    random = "draws" in kwargs  # a random method: each block draws from its own place on
    draws = draws_or_default(kwargs.pop("draws", None))
    for b in blocks:
        if random:
            kwargs["draws"] = draws.at(first_entry(b, out.shape))
        parts = [t[b] for t in tensors]
        merged = (function(base[b], parts, **kwargs) if pass_base and base is not None
                  else function(parts, **kwargs))
        out[b] = merged.to(dtype)
    return out
