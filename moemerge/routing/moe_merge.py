"""Routers of a merge of MoE fine-tunes, recalibrated in closed form (HARC's recipe: merge
everything, then set the routers again; `kind: merge` with `router: {init: calibrate}`).

Merging moves every layer's hidden states, so the merged routers no longer see what each
fine-tune's router was trained on. The targets are the fine-tunes' own routing on the
calibration text: per window, the routing distribution of the input the window's text is
named after (`name=path`: the input's directory name or its reference), or the mean of all
inputs' on a text that names none. Each merged router is fitted to the log of that
distribution by the ridge regression `router.init: calibrate` uses (routing/ridge.py), on the
merged model's own router inputs, layer by layer (earlier layers set first); the log keeps
the fine-tunes' sharpness with no rescaling, as `shrink`'s router repair does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moemerge.errors import RecipeError
from moemerge.plan.sources import SourceModel
from moemerge.routing.calibrate import fit_token_routers, token_rows
from moemerge.routing.calibration import calibration_windows, source_as_stored
from moemerge.routing.modules import find_routers, layout_of
from moemerge.routing.ridge import fit_router, held_out_windows

FLOOR = 1e-9  # a probability no input gave an expert


@dataclass
class TeacherRouting:
    ids: torch.Tensor  # [W, S + 1] calibration windows
    log_targets: dict[int, torch.Tensor]  # layer -> [W·S, E] log routing distribution


def routers_of(model) -> list[tuple[int, torch.nn.Module]]:
    """[(layer, router)] of a loaded token-routed MoE (DeepSeek's dense first layers have
    none)."""
    layout = layout_of(model)
    if layout is None:
        raise RecipeError(f"router.init: calibrate: {type(model).__name__} is not a "
                          "token-routed MoE moemerge knows")
    return find_routers(model, layout.expert_count(model.config.to_dict()))


@torch.no_grad()
def routing_of(model, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """{layer: softmax of the router logits [W·S, E]} of `model` on ids [W, S+1], each
    router reading its own model's hidden states."""
    return {layer: torch.softmax(x.double() @ gate.weight.double().T, dim=-1)
            for layer, gate, x, _ in token_rows(model, ids, routers_of(model))}


def teacher_routing(spec, texts: dict[str, list[str]], tokenizer,
                    models: list[SourceModel]) -> TeacherRouting:
    """The calibration windows and, per layer, the log of the routing the merged inputs
    give them (each window: the input its text names, else the mean of all)."""
    ids, domain, domains = calibration_windows(spec, texts, tokenizer)
    names = {Path(m.label).name: i for i, m in enumerate(models)}  # its directory's name,
    names |= {m.label: i for i, m in enumerate(models)}  # or the recipe's reference
    teacher = {d: names[name] for d, name in enumerate(domains) if name in names}
    per_model = [routing_of(source_as_stored(m), ids) for m in models]
    seq = ids.shape[1] - 1
    owner = torch.tensor([teacher.get(int(d), -1) for d in domain]).repeat_interleave(seq)
    log_targets = {}
    for layer in per_model[0]:
        stacked = torch.stack([routing[layer] for routing in per_model])  # [M, T, E]
        mixed = stacked.mean(0)
        own = stacked[owner.clamp_min(0), torch.arange(stacked.shape[1])]
        chosen = torch.where((owner >= 0)[:, None], own, mixed)
        log_targets[layer] = chosen.clamp_min(FLOOR).log()
    return TeacherRouting(ids, log_targets)


def refit_routers(model, cal: TeacherRouting, stats: dict | None = None
                  ) -> dict[int, torch.Tensor]:
    """{layer: router [E, H] fp32} of the merged `model` fitted to the inputs' routing.
    (`stats`: none kept; `extend` takes token-routed MoEs moemerge assembled.)"""
    def fit(layer: int, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        weight, _ = fit_router(x, cal.log_targets[layer], held_out_windows(window))
        return weight.float()

    return fit_token_routers(model, cal.ids, routers_of(model), fit)
