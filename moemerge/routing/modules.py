"""The router modules of a loaded token-routed MoE (transformers' Mixtral / Qwen-MoE / FlexOlmo /
GraniteMoE classes and their kin): what `inspect routing` hooks and what `router.init:
calibrate` fits.

Each layout's router is found from the architectures table (architectures/moe.yaml), not by
a module name: its on-disk name `model.layers.{layer}.<block>.<path>.weight` gives the module
path below the MoE block (`gate`; GraniteMoE's `router.layer`). transformers may hold the
block under another name in memory (transformers 5: `mlp.gate` for Mixtral's
`block_sparse_moe.gate`) and may fold the path's tail into its parent (transformers 5's
GraniteMoE router keeps its weight on `block_sparse_moe.router`), so the module sought is
`layers.{l}.<any block>.<a leading part of the path>` with a [num_experts, hidden] weight.
"""

from __future__ import annotations

import re

import torch

from moemerge.architectures.tables import MoELayout, moe_layouts


def layout_of(model: torch.nn.Module) -> MoELayout | None:
    """The moe.yaml layout whose architecture the model's config names (else whose
    model_type it has), if any."""
    names = set(getattr(model.config, "architectures", None) or [])
    model_type = getattr(model.config, "model_type", None)
    return next((layout for layout in moe_layouts().values() if layout.architecture in names),
                next((layout for layout in moe_layouts().values()
                      if layout.model_type == model_type), None))


def router_paths(layout: MoELayout) -> list[tuple[str, ...]]:
    """Module paths below the MoE block a router of `layout` may have in memory: its on-disk
    path (`router.layer`) and each leading part of it (`router`)."""
    parts = layout.router.split("{layer}.", 1)[1].removesuffix(".weight").split(".")[1:]
    return [tuple(parts[:n]) for n in range(len(parts), 0, -1)]


def find_routers(model: torch.nn.Module, num_experts: int) -> list[tuple[int, torch.nn.Module]]:
    """[(layer index, router)] of a token-routed MoE, by its layout's router name (every
    layout's when the model's architecture is not in the table), each with a
    [num_experts, hidden] weight (Qwen2-MoE's `shared_expert_gate` is [1, hidden] and named
    otherwise). At most one per layer: the module nearest the on-disk path."""
    layout = layout_of(model)
    layouts = [layout] if layout is not None else list(moe_layouts().values())
    paths = sorted({p for lay in layouts for p in router_paths(lay)}, key=len, reverse=True)
    found: dict[int, tuple[int, torch.nn.Module]] = {}  # layer -> (path length, module)
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        layer = re.search(r"layers\.(\d+)\.[^.]+\.(.+)$", name)
        if layer is None or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        below = tuple(layer.group(2).split("."))
        if below in paths and weight.shape[0] == num_experts:
            index = int(layer.group(1))
            if index not in found or len(below) > found[index][0]:
                found[index] = (len(below), module)
    return [(index, found[index][1]) for index in sorted(found)]
