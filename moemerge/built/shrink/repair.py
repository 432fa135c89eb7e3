"""Router repair: refit each shrunk layer's router to route as the original model did.

Targets: the ORIGINAL model's routing distribution p [T, E] of every calibration token
(stats.py), mapped onto the new experts, q = p Mᵀ with M [K, E] the grouping's membership
(0/1: a merged expert receives its members' whole mass; a pruned expert's mass is dropped) and
each row renormalised. The router is fitted to log q by the ridge regression `router.init:
calibrate` uses (routing/ridge.py: centred targets, λ chosen on held-out windows): softmax
ignores a shift shared by all logits, and log q minus its mean is linear in x whenever q is
the original softmax restricted to kept experts, so on unchanged inputs a pruned layer's fit
is its original rows. Fitting log q rather than q keeps the original's sharpness with no
rescaling. The inputs are the shrunk model's own, layer by layer (earlier layers repaired
first), as `routing/calibrate.py` captures them.
"""

from __future__ import annotations

import torch

from moemerge.built.shrink.prune import Grouping
from moemerge.routing.calibrate import fit_token_routers
from moemerge.routing.modules import find_routers
from moemerge.routing.ridge import fit_router, held_out_windows

FLOOR = 1e-9  # log of a probability no token gave an expert group


def mapped_targets(routing: torch.Tensor, grouping: Grouping) -> torch.Tensor:
    """routing [T, E] -> log of the distribution over the K new experts [T, K]."""
    membership = (grouping.matrix(routing.shape[1]) > 0).to(routing.dtype)  # [K, E]
    mass = routing @ membership.T  # [T, K]
    return (mass / mass.sum(-1, keepdim=True).clamp_min(FLOOR)).clamp_min(FLOOR).log()


def repair_routers(model, ids: torch.Tensor, routing: dict[int, torch.Tensor],
                   groupings: dict[int, Grouping]) -> dict[int, torch.Tensor]:
    """{layer: router [K, H] fp32} of the shrunk `model` (loaded from the written output) on
    the windows ids [W, S+1], the same windows `routing` [T, E] was recorded on."""
    kept = next(iter(groupings.values())).kept
    gates = [(layer, gate) for layer, gate in find_routers(model, kept) if layer in groupings]

    def fit(layer: int, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        targets = mapped_targets(routing[layer].double(), groupings[layer])
        weight, _ = fit_router(x, targets, held_out_windows(window))
        return weight.float()

    return fit_token_routers(model, ids, gates, fit)
