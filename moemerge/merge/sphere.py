"""Methods that treat a tensor as one point on a sphere (its direction and its norm): SLERP,
multi-SLERP, the Karcher mean, Model Stock; and passthrough. Formulas in docs/merge-methods.md.

Every tensor is flattened to one vector (Model Stock's `filter_wise`: one vector per output
row); all arithmetic in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from moemerge.merge.methods import Weights, weights_of

DOT_THRESHOLD = 0.9995  # |cos θ| above this: (anti)parallel, interpolate linearly (mergekit's)
EPS = 1e-8


def slerp(tensors: Sequence[Tensor], t: float = 0.5) -> Tensor:
    """sin((1−t)θ)/sin θ · a + sin(tθ)/sin θ · b, θ the angle between a and b (a = the first
    model, b = the second); (1−t) a + t b when they are nearly (anti)parallel."""
    a, b = (x.float() for x in tensors)
    na, nb = a.norm(), b.norm()
    na, nb = torch.where(na > EPS, na, 1.0), torch.where(nb > EPS, nb, 1.0)
    dot = ((a / na) * (b / nb)).sum().clamp(-1, 1)
    if dot.abs() > DOT_THRESHOLD:
        return (1 - t) * a + t * b
    theta = torch.acos(dot)
    return (torch.sin((1 - t) * theta) * a + torch.sin(t * theta) * b) / torch.sin(theta)


def multislerp(tensors: Sequence[Tensor], weights: Weights = None, base: Tensor | None = None,
               normalize: bool = True) -> Tensor:
    """Barycentric interpolation on the sphere (of the task vectors when there is a base): the
    unit vectors' weighted mean m̂, their tangent components at m̂ averaged into v, the
    exponential map m̂ cos|v| + v̂ sin|v|, scaled by the weighted mean norm."""
    if len(tensors) == 1:
        return tensors[0].float()
    shape = tensors[0].shape
    origin = base.float() if base is not None else None
    points = torch.stack([t.float() if origin is None else t.float() - origin for t in tensors])
    flat = points.reshape(len(tensors), -1)  # [N, n]
    w = weights_of(weights, len(tensors), normalize).to(flat.device)
    norms = flat.norm(dim=1, keepdim=True)  # [N, 1]
    units = flat / (norms + EPS)
    mean = (units * w[:, None]).sum(dim=0)
    if mean.norm() < EPS:
        if len(tensors) != 2:
            raise ValueError("multislerp: the weighted unit vectors cancel out (antipodal "
                             "inputs); change the weights")
        out = (flat * w[:, None]).sum(dim=0)  # two antipodal points: linear
    else:
        mean = mean / mean.norm()
        tangents = units - (units @ mean)[:, None] * mean  # [N, n]
        v = (tangents * w[:, None]).sum(dim=0)
        v_norm = v.norm() + EPS
        out = (mean * torch.cos(v_norm) + v * (torch.sin(v_norm) / v_norm)) * (norms[:, 0] @ w)
    out = out.reshape(shape)
    return out if origin is None else out + origin


def karcher(tensors: Sequence[Tensor], weights: Weights = None, max_iter: int = 10,
            tol: float = 1e-5) -> Tensor:
    """The weighted Riemannian (Karcher) mean of the directions, by fixed-point iteration
    (at most `max_iter` steps, until the tangent step is shorter than `tol`), times the
    weighted mean norm. Zero tensors (norm ≤ tol) do not vote on the direction."""
    if len(tensors) == 1:
        return tensors[0].float()
    flat = [t.float().reshape(-1) for t in tensors]
    w = weights_of(weights, len(tensors), normalize=True).to(flat[0].device)
    norms = torch.stack([x.norm() for x in flat])  # [N]
    live = [i for i in range(len(flat)) if norms[i] > tol]
    if not live:
        return torch.zeros_like(tensors[0], dtype=torch.float32)
    units = torch.stack([flat[i] / norms[i] for i in live])  # [L, n]
    alphas = w[live] / w[live].sum()
    mean = (units * alphas[:, None]).sum(dim=0)
    mean = units[0].clone() if mean.norm() < tol else mean / mean.norm()
    for _ in range(max_iter):
        dots = (units @ mean).clamp(-1, 1)  # [L]
        theta = torch.arccos(dots)
        scale = torch.where(theta < tol, 0.0, alphas * theta / torch.sin(theta))
        tangent = (scale[:, None] * (units - dots[:, None] * mean)).sum(dim=0)
        step = tangent.norm()
        if step < tol:
            break
        mean = torch.cos(step) * mean + torch.sin(step) * tangent / step
        mean = mean / mean.norm() if mean.norm() > tol else mean
    return ((w * norms).sum() * mean).reshape(tensors[0].shape)


def stock_ratio(base: Tensor, tensors: Sequence[Tensor], filter_wise: bool = False) -> Tensor:
    """Model Stock's t = N cos θ / (1 + (N − 1) cos θ), cos θ the mean pairwise cosine of the
    fine-tunes' offsets from the base ([rows, 1] filter-wise, else [1]); 0 where singular."""
    rows = (lambda x: x.reshape(-1, x.shape[-1])) if filter_wise else (lambda x: x.reshape(1, -1))
    offsets = [rows(t.float() - base.float()) for t in tensors]
    cosines = [
        ((a * b).sum(dim=-1) / (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(1e-6)).clamp(-1, 1)
        for i, a in enumerate(offsets) for b in offsets[i + 1:]
    ]
    cos = torch.stack(cosines).mean(dim=0)[:, None]  # [rows, 1]
    n = len(tensors)
    denominator = 1 + (n - 1) * cos
    singular = denominator.abs() < 1e-6
    return torch.where(singular, 0.0, n * cos / torch.where(singular, 1.0, denominator))


def model_stock(base: Tensor, tensors: Sequence[Tensor], filter_wise: bool = False) -> Tensor:
    """t · mean(θ_i) + (1 − t) · θ_base with t = stock_ratio (Jang et al. 2024)."""
    shape = base.shape
    rows = (lambda x: x.reshape(-1, x.shape[-1])) if filter_wise else (lambda x: x.reshape(1, -1))
    t = stock_ratio(base, tensors, filter_wise)
    average = sum(rows(x.float()) for x in tensors) / len(tensors)
    return (t * average + (1 - t) * rows(base.float())).reshape(shape)


def passthrough(tensors: Sequence[Tensor], scale: float | Sequence[float] = 1.0) -> Tensor:
    """The one model's tensor times `scale` (mergekit's per-source scale; 1: unchanged), with
    `slices` from the layer it is taken from."""
    factor = scale if isinstance(scale, int | float) else scale[0]
    return tensors[0].float() if factor == 1.0 else tensors[0].float() * factor


def nuslerp(tensors: Sequence[Tensor], weights: Weights = None, base: Tensor | None = None,
            nuslerp_flatten: bool = True, nuslerp_row_wise: bool = False) -> Tensor:
    """NuSLERP (mergekit's, 2024): SLERP of two models, or of their task vectors from a base
    (θ_b + slerp(τ_1, τ_2)), at t = w_2 / (w_1 + w_2) from the models' weights (0.5 when
    they sum to less than 1e-6). One angle for the whole tensor (`nuslerp_flatten`), else
    one per vector along the last axis (a matrix's rows) or, with `nuslerp_row_wise`, along
    the first (its columns). Per pair of vectors a, b: cos Ω = â · b̂, result
    sin((1−t)Ω)/sin Ω · a + sin(tΩ)/sin Ω · b; (1−t) a + t b where 1 − cos²Ω ≤ 1e-16
    (parallel to float32 precision). A zero vector has unit 0, so it counts as orthogonal:
    nuslerp(0, b) = sin(tπ/2) · b, as in mergekit."""
    origin = None if base is None else base.float()
    a, b = (t.float() if origin is None else t.float() - origin for t in tensors)
    w = weights_of(weights, 2, normalize=False)
    total = w.sum().item()
    t = 0.5 if abs(total) < 1e-6 else w[1].item() / total
    shape = a.shape
    if nuslerp_flatten:
        a, b = a.reshape(1, -1), b.reshape(1, -1)  # [1, n]: one vector
    elif nuslerp_row_wise:
        a, b = a.transpose(0, -1), b.transpose(0, -1)  # vectors along the first axis
    out = _slerp_last_axis(a, b, t)
    if nuslerp_row_wise and not nuslerp_flatten:
        out = out.transpose(0, -1)
    out = out.reshape(shape)
    return out if origin is None else out + origin


def _slerp_last_axis(a: Tensor, b: Tensor, t: float) -> Tensor:
    """SLERP of each pair of vectors along the last axis ([..., n] -> [..., n])."""
    unit_a = a / a.norm(dim=-1, keepdim=True).clamp_min(1e-7)  # a zero vector stays 0
    unit_b = b / b.norm(dim=-1, keepdim=True).clamp_min(1e-7)
    cos = (unit_a * unit_b).sum(dim=-1, keepdim=True).clamp(-1, 1)  # [..., 1]
    parallel = 1 - cos * cos <= 1e-16
    omega = torch.acos(torch.where(parallel, 0.0, cos))  # π/2 on the linear branch: finite
    spherical = (torch.sin((1 - t) * omega) * a + torch.sin(t * omega) * b) / torch.sin(omega)
    return torch.where(parallel, (1 - t) * a + t * b, spherical)
