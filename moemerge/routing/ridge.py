"""Closed-form routers: ridge regression from router inputs to expert targets (docs/routing.md).

A router is a linear map h [H] -> logits [E]. Given calibration rows X [N, H] (the router's
inputs) and targets Y [N, E] (a one-hot of the row's domain expert, or a softmax of the
experts' negative losses), the router W [E, H] minimises ‖X Wᵀ − Y_c‖² + λ‖W‖², Y_c = Y minus
each row's mean over experts (softmax ignores a shift shared by every logit, so the fit should
not spend capacity on one). Solved in float64 through the normal equations, which need only
[H, H] and [H, E] accumulators; λ is chosen on held-out rows; the rows are then scaled so
routing is decisive but not saturated (`decisive_scale`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# λ candidates, relative to the mean eigenvalue trace(XᵀX)/H (the fit's natural scale)
RELATIVE_LAMBDAS = tuple(10.0 ** p for p in range(-6, 3))
BLOCK_ROWS = 8192


@dataclass
class NormalEquations:
    """XᵀX [H, H], XᵀY [H, E] and ‖Y‖² of a set of rows, in float64."""

    gram: torch.Tensor
    cross: torch.Tensor
    yy: float

    def __add__(self, other: NormalEquations) -> NormalEquations:
        return NormalEquations(self.gram + other.gram, self.cross + other.cross,
                               self.yy + other.yy)


def normal_equations(x: torch.Tensor, y: torch.Tensor) -> NormalEquations:
    """x [N, H], y [N, E] -> their normal equations, accumulated block by block in float64."""
    gram = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
    cross = torch.zeros(x.shape[1], y.shape[1], dtype=torch.float64)
    yy = 0.0
    for start in range(0, x.shape[0], BLOCK_ROWS):
        xb, yb = x[start:start + BLOCK_ROWS].double(), y[start:start + BLOCK_ROWS].double()
        gram.addmm_(xb.T, xb)
        cross.addmm_(xb.T, yb)
        yy += float((yb * yb).sum())
    return NormalEquations(gram, cross, yy)


def ridge_solution(eq: NormalEquations, lam: float) -> torch.Tensor:
    """argmin_W ‖X W − Y‖² + λ‖W‖²: (XᵀX + λI)⁻¹ XᵀY, [H, E] float64."""
    eye = torch.eye(eq.gram.shape[0], dtype=torch.float64)
    return torch.linalg.solve(eq.gram + lam * eye, eq.cross)


def squared_error(eq: NormalEquations, w: torch.Tensor) -> float:
    """‖X W − Y‖² from the normal equations alone: tr(Wᵀ XᵀX W) − 2 tr(Wᵀ XᵀY) + ‖Y‖²."""
    return float((w * (eq.gram @ w)).sum() - 2 * (w * eq.cross).sum()) + eq.yy


def centre(y: torch.Tensor) -> torch.Tensor:
    """Targets [N, E] minus each row's mean over experts."""
    return y - y.mean(dim=-1, keepdim=True)


def fit_router(x: torch.Tensor, y: torch.Tensor, held_out: torch.Tensor
               ) -> tuple[torch.Tensor, float]:
    """x [N, H] router inputs, y [N, E] targets, held_out [N] bool -> (W [E, H] float64, λ).

    λ = the relative candidate with the least held-out squared error when fitted on the other
    rows, times trace(XᵀX)/H; the returned W is refitted on every row with it."""
    y = centre(y.double())
    fit = normal_equations(x[~held_out], y[~held_out])
    test = None
    if bool(held_out.any()) and bool((~held_out).any()):
        test = normal_equations(x[held_out], y[held_out])
    return solve_equations(fit, test)


def solve_equations(fit: NormalEquations, test: NormalEquations | None
                    ) -> tuple[torch.Tensor, float]:
    """fit_router from the normal equations of the fitted rows and (None: none held out) of
    the held-out ones, centred targets: (W [E, H] float64, λ)."""
    everything = fit
    relative = 1e-3  # too few rows to hold any out: a light default
    if test is not None:
        scale = _trace_scale(fit)
        errors = [squared_error(test, ridge_solution(fit, r * scale)) for r in RELATIVE_LAMBDAS]
        relative = RELATIVE_LAMBDAS[min(range(len(errors)), key=errors.__getitem__)]
        everything = fit + test
    lam = relative * _trace_scale(everything)
    return ridge_solution(everything, lam).T.contiguous(), lam


def _trace_scale(eq: NormalEquations) -> float:
    return max(float(eq.gram.diagonal().mean()), 1e-12)


def decisive_scale(logits: torch.Tensor, confidence: float, iterations: int = 60,
                   weights: torch.Tensor | None = None) -> float:
    """c > 0 such that softmax(c · logits) has mean largest probability `confidence` over the
    rows of logits [N, E] (that mean grows with c, so bisect log c). Too small a c leaves
    routing near uniform (top-k weights equal, the choice barely matters); too large saturates
    it (one-hot weights, no gradient for a later fine-tune). `weights` [N]: how many rows
    each row stands for (a sample of rows: `moemerge extend`); None: one each."""
    z = logits.double()
    if z.shape[-1] < 2 or float((z - z.mean(-1, keepdim=True)).abs().max()) == 0.0:
        return 1.0  # nothing to scale: one expert, or logits that do not tell rows apart

    def top1(c: float) -> float:
        best = torch.softmax(c * z, dim=-1).amax(dim=-1)
        if weights is None:
            return float(best.mean())
        return float((best * weights).sum() / weights.sum())

    low, high = -12.0, 12.0  # log c
    for _ in range(iterations):
        mid = (low + high) / 2
        low, high = (mid, high) if top1(10.0 ** mid) < confidence else (low, mid)
    return 10.0 ** ((low + high) / 2)


# `confidence: fit` never scales past this mean top-1 probability: separable rows would push the
# fitted scale to infinity (one-hot routing, no gradient left for a later fine-tune)
MAX_FITTED_CONFIDENCE = 0.99


def fitted_scale(logits: torch.Tensor, targets: torch.Tensor, iterations: int = 60,
                 weights: torch.Tensor | None = None) -> float:
    """c > 0 minimising the cross-entropy of softmax(c · logits) [N, E] against targets [N, E]
    (rows of probabilities: one-hot domains or soft loss targets): temperature scaling. The loss
    is convex in c, its derivative Σ_n w_n (E_softmax[z_n] − E_target[z_n]) increasing, so its
    root is bisected on log c. Bounded to the scales whose mean top-1 probability lies between
    uniform and MAX_FITTED_CONFIDENCE (a router no better than chance gets the low end).
    `weights` [N]: rows each row stands for (None: one each)."""
    z, y = logits.double(), targets.double()
    if z.shape[-1] < 2 or float((z - z.mean(-1, keepdim=True)).abs().max()) == 0.0:
        return 1.0
    w = torch.ones(z.shape[0], dtype=torch.float64) if weights is None else weights.double()
    target_mean = ((y * z).sum(-1) * w).sum()

    def slope(c: float) -> float:
        return float(((torch.softmax(c * z, -1) * z).sum(-1) * w).sum() - target_mean)

    high = math.log10(decisive_scale(z, MAX_FITTED_CONFIDENCE, weights=weights))
    low = high - 12.0
    if slope(10.0 ** high) <= 0:
        return 10.0 ** high
    if slope(10.0 ** low) >= 0:
        return 10.0 ** low
    for _ in range(iterations):
        mid = (low + high) / 2
        low, high = (mid, high) if slope(10.0 ** mid) < 0 else (low, mid)
    return 10.0 ** ((low + high) / 2)


def held_out_windows(window: torch.Tensor, every: int = 5) -> torch.Tensor:
    """window [N] index of each row's calibration window -> [N] bool: every `every`-th window
    is held out (whole windows: neighbouring tokens are too alike to test a fit on)."""
    return window % every == every - 1
