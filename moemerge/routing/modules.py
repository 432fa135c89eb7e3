"""The router modules of a loaded token-routed MoE (transformers' Mixtral / Qwen-MoE classes and
their kin): what `inspect routing` hooks and what `router.init: calibrate` fits."""

from __future__ import annotations

import re

import torch


def find_routers(model: torch.nn.Module, num_experts: int) -> list[tuple[int, torch.nn.Module]]:
    """[(layer index, router)] for modules named `gate` with a [num_experts, hidden] weight
    (Qwen2-MoE's `shared_expert_gate` is [1, hidden] and named otherwise)."""
    routers = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if name.rsplit(".", 1)[-1] != "gate" or not isinstance(weight, torch.Tensor):
            continue
        layer = re.search(r"layers\.(\d+)\.", name)
        if weight.dim() == 2 and weight.shape[0] == num_experts and layer:
            routers.append((int(layer.group(1)), module))
    return sorted(routers, key=lambda pair: pair[0])
