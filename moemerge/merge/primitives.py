"""The steps the merging papers are made of, as pure tensor functions.

Every function computes in and returns float32 (inputs are cast with `.float()`); τ stacks
have shape [N, *shape] (one task vector per model along the first axis). No names, no IO, no
global random state. Conventions (also in docs/merge-methods.md): TIES keeps ceil(density·n)
entries per task vector, ties at the threshold included; the sign is elected by mass (sum), a
zero sum elects 0 and drops the entry; DARE draws its mask from counter-based per-tensor
draws (merge/draws.py: the same bytes on every device, in any block order).
Each has a switch to mergekit's convention (floor, a zero vote elects +, L1 rescale).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from moemerge.merge.draws import Draws
from moemerge.words import plural


def task_vectors(base: Tensor, tensors: Sequence[Tensor]) -> Tensor:
    """τ_i = θ_i − θ_base, stacked: [N, *shape], one allocation (each model is cast into its
    slot, then the base subtracted in place: the same values as θ_i.float() − θ_base.float())."""
    out = torch.empty((len(tensors), *base.shape), dtype=torch.float32, device=base.device)
    for slot, tensor in zip(out, tensors, strict=True):
        slot.copy_(tensor)
    return out.sub_(base.float())


PerModel = float | Sequence[float]  # one value for every model, or one per model


def per_model(value: PerModel, n: int) -> list[float]:
    """A parameter's value for each of `n` models: a scalar repeated, or its own per model."""
    if isinstance(value, int | float):
        return [float(value)] * n
    values = [float(v) for v in value]
    if len(values) != n:
        raise ValueError(f"{plural(len(values), 'per-model value')} for {plural(n, 'model')}")
    return values


def check_density(density: float) -> None:
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density}")


def keep_count(numel: int, density: float, rounding: str = "ceil") -> int:
    """How many entries TIES keeps: ceil(density · numel), at least one. Ceil, so a density
    never keeps fewer entries than asked (the 1e-9 absorbs float error: 0.7 · 10 is 7.000…1).
    rounding "floor": int(density · numel), at least one, mergekit's count."""
    if rounding == "floor":
        return max(1, min(numel, int(density * numel)))
    return max(1, min(numel, math.ceil(density * numel - 1e-9)))


def trim_to_density(taus: Tensor, density: PerModel, rounding: str = "ceil",
                    thresholds: Tensor | None = None) -> Tensor:
    """TIES "trim": per task vector keep the top `density` fraction of entries by magnitude
    (one density for all, or one per model).

    The threshold is the k-th largest |τ| found with `kthvalue` (linear time, no sort); entries
    tied with it are kept, so slightly more than k may survive. density 1 keeps everything.
    `thresholds` [N]: the cut-offs, found beforehand over the whole tensor (a row block's trim,
    merge/blocks.py)."""
    densities = per_model(density, taus.shape[0])
    for d in densities:
        check_density(d)
    taus = taus.float()
    if all(d == 1.0 for d in densities):
        return taus
    flat = taus.reshape(taus.shape[0], -1).abs()  # [N, numel]
    if rounding == "sort":
        keep = torch.stack([sorted_top(row, d) for row, d in zip(flat, densities, strict=True)])
        return (taus.reshape(flat.shape) * keep).reshape(taus.shape)
    if thresholds is None:
        thresholds = torch.stack([trim_threshold(row, d, rounding)
                                  for row, d in zip(flat, densities, strict=True)])
    return (taus.reshape(flat.shape) * (flat >= thresholds[:, None])).reshape(taus.shape)


def sorted_top(magnitudes: Tensor, density: float) -> Tensor:
    """[numel] bool: the first max(1, ⌊d·n⌋) entries of torch's descending argsort of one flat
    task vector's magnitudes (float32), every entry at density 1: exactly the entries mergekit's
    `magnitude` sparsifier keeps, ties at the cut-off included (argsort is not stable; its order
    among equal values is the same for the same values in the same torch)."""
    keep = torch.zeros(magnitudes.shape, dtype=torch.bool, device=magnitudes.device)
    if density == 1.0:
        return keep.fill_(True)
    keep[torch.argsort(magnitudes.float(), descending=True)[:keep_count(
        magnitudes.numel(), density, "floor")]] = True
    return keep


def trim_threshold(magnitudes: Tensor, density: float, rounding: str = "ceil") -> Tensor:
    """The smallest magnitude the trim keeps in one flat task vector: the k-th largest
    (the (numel − k + 1)-th smallest), or 0 at density 1 (everything kept)."""
    if density == 1.0 or magnitudes.numel() == 0:
        return magnitudes.new_zeros(())
    numel = magnitudes.numel()
    return magnitudes.kthvalue(numel - keep_count(numel, density, rounding) + 1).values


def _per_model(weights: Tensor, taus: Tensor) -> Tensor:
    """[N] weights -> [N, 1, …, 1], to broadcast against a [N, *shape] stack."""
    return weights.to(device=taus.device, dtype=torch.float32).reshape(
        -1, *([1] * (taus.dim() - 1)))


def _unit(weights: Tensor | None) -> bool:
    """No weights, or all 1: multiplying by them is exact, so it can be skipped."""
    return weights is None or bool((weights == 1).all())


def _weighted(taus: Tensor, weights: Tensor | None) -> Tensor:
    return taus if _unit(weights) else taus * _per_model(weights, taus)


def elect_sign(taus: Tensor, weights: Tensor | None = None, consensus: str = "sum",
               zero_vote: str = "none") -> Tensor:
    """TIES "elect": each entry's sign is that of the (weighted) sum of the task vectors, i.e.
    the side with more total mass wins, not the side with more models. A zero sum gives 0.
    consensus "count": the sign of the sum of the signs (more models win). zero_vote
    "positive": a vote summing to exactly 0 elects + (mergekit)."""
    weighted = _weighted(taus.float(), weights)
    vote = (torch.sign(weighted) if consensus == "count" else weighted).sum(dim=0)
    sign = torch.sign(vote)
    return torch.where(vote == 0, 1.0, sign) if zero_vote == "positive" else sign


def disjoint_mean(taus: Tensor, sign: Tensor, weights: Tensor | None = None,
                  normalize: bool = True) -> Tensor:
    """TIES "disjoint merge": per entry, the weighted mean over the models whose (nonzero) τ has
    the elected sign; zeros and disagreeing entries are excluded; no agreeing model gives 0.
    normalize False: the weighted sum of the agreeing entries, not their mean."""
    return disjoint_mean_(taus.to(torch.float32, copy=True), sign, weights, normalize)


def disjoint_mean_(taus: Tensor, sign: Tensor, weights: Tensor | None,
                   normalize: bool) -> Tensor:
    """disjoint_mean that overwrites `taus` (float32, owned by the caller): no stack-sized
    temporaries beyond the agreement mask. Unit weights are not multiplied (exact either way)."""
    agree = (torch.sign(taus) == sign.to(taus.device)) & (taus != 0)  # [N, *shape]
    # [N, *shape]: a model's weight where it counts, else 0 (bool for unit weights)
    w = agree if _unit(weights) else _per_model(weights, taus) * agree
    total = w.sum(dim=0, dtype=torch.float32)
    merged = taus.mul_(w).sum(dim=0)
    if not normalize:
        return merged
    # no agreeing model: 0 / tiny · 0 = 0, never a NaN
    return merged.div_(total.clamp_min(torch.finfo(torch.float32).tiny)).mul_(total > 0)


def dare_drop(tau: Tensor, density: float, draws: Draws, model: int,
              rescale: bool | str = "expectation", l1_scale: Tensor | None = None) -> Tensor:
    """DARE: drop each entry with probability 1 − density; survivors × 1/density (rescale keeps
    the expectation; "l1": × |τ|₁ / |kept|₁, mergekit; "none" or False: not rescaled). The mask
    is model `model`'s of `draws`, so it does not depend on the device or the block order.
    density 1 returns τ unchanged. `l1_scale`: the L1 factor of the whole tensor, when `tau` is
    one row block of it (blocks.dare_l1)."""
    check_density(density)
    tau = tau.float()
    if density == 1.0:
        return tau
    return rescale_kept(tau, draws.keep(model, tau, density), density, rescale, l1_scale)


def rescale_kept(tau: Tensor, kept: Tensor, prob: Tensor | float, rescale: bool | str,
                 l1_scale: Tensor | None = None) -> Tensor:
    """Rescale the survivors of a random drop: "expectation" (or True) divides each by its keep
    probability `prob`, so E[kept] = τ; "l1" matches the L1 norm of the whole tensor, left as is
    when either norm is below 1e-7 (mergekit's rescaled_masked_tensor; `l1_scale`, that factor
    found over the whole tensor when `tau` is a block of it); "none" (or False) does nothing."""
    if rescale in (True, "expectation"):
        return kept / on_device(prob, kept)
    if rescale == "l1":
        return kept * (l1_scale if l1_scale is not None else l1_factor(tau.abs().sum(),
                                                                        kept.abs().sum()))
    return kept


def on_device(scalar: Tensor | float, like: Tensor) -> Tensor:
    """A divisor as a float32 tensor on `like`'s device: CUDA divides by a CPU scalar as a
    multiplication by its reciprocal (off by an ulp), by a device tensor exactly, as the CPU."""
    return torch.as_tensor(scalar, dtype=torch.float32, device=like.device)


def l1_factor(before: Tensor, after: Tensor) -> Tensor:
    """|τ|₁ / |kept|₁, or 1 where either norm is below 1e-7 (mergekit leaves those as they are)."""
    small = (before < 1e-7) | (after < 1e-7)
    return torch.where(small, torch.ones_like(before), before / torch.where(small, 1.0, after))


def generator_for(seed: int, name: str) -> torch.Generator:
    """A CPU generator for one output tensor, from (recipe seed, tensor name): the same bytes
    whatever the order in which tensors are made or how many threads make them."""
    digest = hashlib.sha256(f"{seed}\x00{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def zero_pad(tensor: Tensor, shape: Sequence[int]) -> Tensor:
    """`tensor` zero-padded at the end of each axis to `shape` (unchanged when it fits exactly):
    a narrower expert's [V, d_i] embedding becomes [V, d_m] with zeros in columns d_i..d_m."""
    if tuple(tensor.shape) == tuple(shape):
        return tensor
    if tensor.dim() != len(shape) or any(a > b for a, b in zip(tensor.shape, shape, strict=True)):
        raise ValueError(f"cannot zero-pad a tensor of shape {list(tensor.shape)} to {list(shape)}")
    out = tensor.new_zeros(shape)
    out[tuple(slice(0, n) for n in tensor.shape)] = tensor
    return out


def count_non_finite(tensor: Tensor, chunk: int = 1 << 22) -> int:
    """How many NaN / ±Inf entries a floating-point tensor holds (0 for integer tensors).
    First one sum in the tensor's own dtype (NaN and Inf propagate, so a finite sum means a
    finite tensor; the kernel accumulates in float32 without a copy, where `sum(dtype=float32)`
    of a bf16 tensor makes a float32 copy of it: 2.5 GB at a 152k × 4096 embedding). Only when
    the sum is not finite (or a float16 sum of finite values overflows) are the entries
    counted, chunk by chunk, so no full-size mask is made."""
    if not tensor.is_floating_point() or torch.isfinite(tensor.sum()):
        return 0
    flat = tensor.reshape(-1)
    return sum(int((~torch.isfinite(flat[i:i + chunk])).sum())
               for i in range(0, flat.numel(), chunk))
