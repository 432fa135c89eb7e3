"""The shrunk checkpoint's tensors, in the input's own layout, each made when the writer asks.

Per layer, new expert j = Σ_e A[j, e] · old expert e along the expert axis (A [K, E] the
grouping's matrix): per-expert tensors ([I, H] / [H, I] each) and fused ones ([E, rows, cols],
GraniteMoE) alike; the router [E, H] becomes [K, H] with the grouping's row weights. A group of
one expert is a plain copy, bit for bit. Everything else (attention, norms, embedding, head, a
shared expert and its gate) is copied unchanged.
"""

from __future__ import annotations

import torch

from moemerge.architectures.forms import name_pattern
from moemerge.architectures.tables import MoELayout
from moemerge.built.shrink.prune import Grouping
from moemerge.errors import RecipeError
from moemerge.io.reader import CheckpointReader
from moemerge.io.tensor_list import DenseTensor, Extraction
from moemerge.merge.dispatch import merge
from moemerge.merge.registry import REGISTRY
from moemerge.recipe.shrink import WEIGHTED
from moemerge.words import plural


def _combined(tensors: list[torch.Tensor], weights: list[float],
              method: str = WEIGHTED) -> torch.Tensor:
    """Σ w_i · t_i in fp32 (or `method` from the registry, given the weights where it takes
    them), cast back to the tensors' dtype; one tensor: itself."""
    if len(tensors) == 1:
        return tensors[0]
    if method != WEIGHTED:
        spec = REGISTRY[method]
        return merge(method, base=None, tensors=[t.float() for t in tensors],
                     weights=weights if spec.weights else None, dtype=tensors[0].dtype)
    total = sum(w * t.float() for w, t in zip(weights, tensors, strict=True))
    return total.to(tensors[0].dtype)


def check_group_sizes(groupings: dict[int, Grouping], method: str) -> None:
    """A RecipeError before anything is written when `method` cannot take a group's size."""
    most = None if method == WEIGHTED else REGISTRY[method].max_models
    for layer, grouping in groupings.items():
        big = max(len(g) for g in grouping.groups)
        if most is not None and big > most:
            raise RecipeError(f"merge_method: {method} merges at most {most} experts, and "
                              f"layer {layer} groups {big} of them; keep more experts or use "
                              "weighted, karcher or multislerp")


def _rows(tensor: torch.Tensor, grouping: Grouping, rows: bool,
          method: str = WEIGHTED) -> torch.Tensor:
    """tensor [E, ...] -> [K, ...] along the expert axis: router rows by their weighted mean,
    fused expert weights by `method`."""
    weights = grouping.row_weights if rows else grouping.weights
    return torch.stack([_combined([tensor[e] for e in g], w, WEIGHTED if rows else method)
                        for g, w in zip(grouping.groups, weights, strict=True)])


def shrunk_tensors(reader: CheckpointReader, layout: MoELayout, groupings: dict[int, Grouping],
                   method: str = WEIGHTED) -> list[DenseTensor]:
    """Every output tensor, in the input's order (a layer's new experts where its old ones
    were); a group's experts combined by `method` (the recipe's merge_method)."""
    expert = name_pattern(layout.expert)
    routers = [name_pattern(t) for t in (layout.router, layout.router_bias) if t]
    fused = [name_pattern(t) for t in layout.fused]
    on_disk = {disk: proj for proj, disk in layout.projections.items()}
    out = Extraction({})
    for name in reader.names():
        meta = reader.meta(name)
        found = expert.fullmatch(name)
        if found and int(found["layer"]) in groupings:
            layer, proj = int(found["layer"]), on_disk[found["proj"]]
            if int(found["expert"]) == 0:  # the layer's K new experts, once per projection
                for j, (group, weights) in enumerate(zip(groupings[layer].groups,
                                                         groupings[layer].weights, strict=True)):
                    def make(layer=layer, proj=proj, group=group, weights=weights):
                        return _combined([reader.read(layout.expert_name(layer, e, proj))
                                          for e in group], weights, method)
                    out.tensors.append(DenseTensor(layout.expert_name(layer, j, proj),
                                                   meta.dtype, meta.shape, make))
            continue
        match = next((m for p in [*routers, *fused] if (m := p.fullmatch(name))), None)
        if match and int(match["layer"]) in groupings:
            grouping, is_router = groupings[int(match["layer"])], match.re in routers
            out.tensors.append(DenseTensor(
                name, meta.dtype, (grouping.kept, *meta.shape[1:]),
                lambda name=name, g=grouping, r=is_router: _rows(reader.read(name), g, r,
                                                                 method)))
            continue
        out.copy(reader, name)
    return out.tensors


def shrunk_config(config: dict, layout: MoELayout, kept: int) -> tuple[dict, list[str]]:
    """(config.json of the shrunk MoE, notes): the expert count set to K, experts_per_token
    clipped to K."""
    new = {**config, layout.experts_key(config): kept}
    notes = []
    top_k = int(config.get("num_experts_per_tok", 1))
    if top_k > kept:
        new["num_experts_per_tok"] = kept
        notes.append(f"num_experts_per_tok {top_k} is more than the {plural(kept, 'expert')} kept: "
                     f"clipped to {kept} (every token now goes to every expert)")
    return new, notes
