"""`router.init: calibrate`: set a built MoE's routers from calibration windows (docs/routing.md).

The model is the merged MoE itself (loaded in its own dtype from the build, written with placeholder
routers), so each router is fitted on the inputs it will see. Token and merged-experts
routers are fitted layer by layer: layer l's inputs are captured with the routers of layers
< l already set (their choices change what reaches layer l), walking down the decoder stack
once with the windows' hidden states kept between layers (routing/capture.py). Sequence
routers read the (RMS-normalised) mean embedding: one pass, no decoder layer runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moemerge.routing.capture import BATCH, layer_rows
from moemerge.routing.modules import find_routers, layout_of
from moemerge.routing.ridge import (
    centre,
    decisive_scale,
    fit_router,
    fitted_scale,
    held_out_windows,
    normal_equations,
    ridge_solution,
)


@dataclass
class Calibration:
    ids: torch.Tensor  # [W, S + 1] token windows: inputs ids[:, :-1], next tokens ids[:, 1:]
    targets: torch.Tensor  # [W, S, E] expert targets per input position (each sums to 1)
    # the mean top-1 routing probability the rows are scaled to, or "fit": each router's scale
    # fitted to the targets of held-out windows (temperature scaling, ridge.fitted_scale)
    confidence: float | str


def domain_targets(domain: torch.Tensor, expert_of: list[int], num_experts: int,
                   seq_len: int) -> torch.Tensor:
    """domain [W] index of each window's domain, expert_of[d] its expert -> one-hot [W, S, E]."""
    experts = torch.tensor(expert_of)[domain]  # [W]
    return F.one_hot(experts, num_experts).float()[:, None].expand(-1, seq_len, -1).contiguous()


def loss_targets(nll: torch.Tensor) -> torch.Tensor:
    """nll [E, W, S] each expert's next-token loss -> softmax over experts of −nll [W, S, E]."""
    return torch.softmax(-nll.double(), dim=0).permute(1, 2, 0).float()


@torch.no_grad()
def token_nll(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token NLL of a dense causal LM at every input position: ids [W, S+1] -> [W, S]."""
    rows = []
    for start in range(0, ids.shape[0], BATCH):
        batch = ids[start:start + BATCH]
        logits = model(input_ids=batch[:, :-1]).logits.float()  # [B, S, V]
        rows.append(F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none"))
    return torch.cat(rows)


def _solve(x: torch.Tensor, y: torch.Tensor, window: torch.Tensor, confidence: float | str,
           temperature: float = 1.0) -> torch.Tensor:
    """Ridge router [E, H] fp32 from rows x [R, H] and targets y [R, E], scaled so that
    softmax(x Wᵀ / temperature) has mean top-1 probability `confidence`, or ("fit") by the
    scale that best predicts the targets of the held-out windows."""
    held_out = held_out_windows(window)
    w, lam = fit_router(x, y, held_out)
    if confidence == "fit":
        scale = held_out_scale(x, y, held_out, lam, w)
    else:
        scale = decisive_scale(x.double() @ w.T, confidence)
    return (w * scale * temperature).float()


def held_out_scale(x: torch.Tensor, y: torch.Tensor, held_out: torch.Tensor, lam: float,
                   w: torch.Tensor) -> float:
    """The temperature-scaling fit of the router's scale: on the held-out rows, through the
    router fitted without them (the same λ), so that the scale is not fitted to rows the
    router has memorised; on every row, through w [E, H], when none or all are held out."""
    if not bool(held_out.any()) or bool(held_out.all()):
        return fitted_scale(x.double() @ w.T, y)
    fit_rows = normal_equations(x[~held_out], centre(y[~held_out].double()))
    w_fit = ridge_solution(fit_rows, lam).T  # [E, H]
    return fitted_scale(x[held_out].double() @ w_fit.T, y[held_out])


def token_gates(model, num_experts: int) -> list[torch.nn.Module]:
    """Each decoder layer's router module (weight [E, H], found by the layout's router name in
    the architectures table), in layer order."""
    found = find_routers(model, num_experts)
    layers = [layer for layer, _ in found]
    if layers != list(range(len(model.model.layers))):
        layout = layout_of(model)
        named = f"{layout.name}'s router {layout.router}" if layout else "a router"
        raise ValueError(f"expected {named} with {num_experts} rows in every decoder layer, "
                         f"found it in layers {layers}")
    return [router for _, router in found]


RouterFit = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def fit_token_routers(model, ids: torch.Tensor, gates: list[tuple[int, torch.nn.Module]],
                      fit: RouterFit) -> dict[int, torch.Tensor]:
    """{layer: router [E, H]}: each gate in layer order set to fit(layer, rows [R, H], window
    of each row [R]) on its inputs over the windows ids [W, S+1] (R = W·S), and written into
    the model before the next layer's inputs are captured."""
    routers = {}
    for layer, gate, x, window in token_rows(model, ids, gates):
        routers[layer] = fit(layer, x, window)
        gate.weight.data.copy_(routers[layer])
    return routers


def token_rows(model, ids: torch.Tensor, gates: list[tuple[int, torch.nn.Module]]
               ) -> Iterator[tuple[int, torch.nn.Module, torch.Tensor, torch.Tensor]]:
    """(layer, gate, rows [R, H], window [R]) each router `gate` sees over the windows ids
    [W, S+1], one row per calibration token, in layer order (routing/capture.py: a router set
    between two of them changes what the next layers see)."""
    for layer, gate, x, window in layer_rows(model, ids, [(layer, gate, gate)
                                                          for layer, gate in gates]):
        if x.shape[0] != ids.shape[0] * (ids.shape[1] - 1):
            raise ValueError(f"layer {layer}: the router saw {x.shape[0]} rows, expected one "
                             "per calibration token")
        yield layer, gate, x, window


def calibrate_token_routers(model, cal: Calibration, stats: dict | None = None
                            ) -> dict[int, torch.Tensor]:
    """{layer: router [E, H]} of a token-routed MoE (every layer's targets the same).
    `stats`, when given, receives each layer's LayerStatistics (routing/statistics.py: what
    `moemerge extend` refits from)."""
    from moemerge.routing.statistics import layer_statistics

    num_experts = cal.targets.shape[-1]
    targets = cal.targets.reshape(-1, num_experts)

    def fit(layer: int, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        if stats is not None:
            stats[layer] = layer_statistics(x, targets, held_out_windows(window))
        return _solve(x, targets, window, cal.confidence)

    return fit_token_routers(model, cal.ids, list(enumerate(token_gates(model, num_experts))),
                             fit)


def calibrate_merged_routers(model, cal: Calibration, stats: dict | None = None
                             ) -> dict[int, torch.Tensor]:
    """{layer: router [E, H]} of a merged-experts MoE, fitted on the segment means each layer's
    router reads (the running means of segment 0 included), each row's target the mean target
    of its window. (`stats`: none kept; `extend` calibrates these routers again.)"""
    per_window = cal.targets.mean(dim=1)  # [W, E]
    routers = {}
    for layer, router, x, window in layer_rows(
            model, cal.ids, [(layer, mlp.router, mlp) for layer, mlp in enumerate(model.mlps())]):
        routers[layer] = _solve(x, per_window[window], window, cal.confidence)
        router.weight.data.copy_(routers[layer])
    return routers


def calibrate_lora_routers(model, cal: Calibration, stats: dict | None = None
                           ) -> dict[str, torch.Tensor]:
    """{router tensor name: [E, H]} of an MoE of LoRA experts: each block's router fitted on
    the block's input, in layer order (the attention's router before the MLP's, whose input
    it changes), every layer's targets the same. (`stats`: none kept; no `extend`.)"""
    num_experts = cal.targets.shape[-1]
    targets = cal.targets.reshape(-1, num_experts)
    names = {router: name for name, router in model.router_modules().items()}
    taps = [(int(name.split(".")[2]), router, router) for router, name in names.items()]
    routers = {}
    for _, router, x, window in layer_rows(model, cal.ids, taps):
        routers[f"{names[router]}.weight"] = _solve(x, targets, window, cal.confidence)
        router.weight.data.copy_(routers[f"{names[router]}.weight"])
    return routers


@torch.no_grad()
def calibrate_sequence_router(model, cal: Calibration) -> torch.Tensor:
    """The learned router [N, d_m] of a seq_routed / bridged MoE, on its router input (the
    mean embedding of each window), each window's target its mean target; scaled for the
    model's routing temperature."""
    x = torch.cat([model.router_input(cal.ids[s:s + BATCH, :-1]).float()
                   for s in range(0, cal.ids.shape[0], BATCH)])  # [W, d_m]
    window = torch.arange(x.shape[0])
    return _solve(x, cal.targets.mean(dim=1), window, cal.confidence,
                  model.config.routing_temperature)


def calibrate_sequence_routers(model, cal: Calibration, stats: dict | None = None
                               ) -> dict[None, torch.Tensor]:
    """{None: the one sequence router}, as the other kinds' calibrators give theirs by layer."""
    return {None: calibrate_sequence_router(model, cal)}
