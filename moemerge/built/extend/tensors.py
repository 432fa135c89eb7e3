"""The tensors of a token-routed MoE grown by new experts, each made when the writer asks.

Every tensor of the MoE is copied, except in each layer's sparse block: the new experts' gate /
up / down [I, H] / [I, H] / [H, I] (their dense FFN, cast to the MoE's dtype) are added as
experts E, E+1, ... in the layout's names (a fused layout's [E, rows, cols] tensor grows along
E), and each router [E, H] becomes a zero placeholder [E + n, H] that the refit overwrites.
"""

from __future__ import annotations

import torch

from moemerge.architectures.tables import MoELayout
from moemerge.errors import MismatchError
from moemerge.io.moe_expert import PROJECTIONS, expert_ffn, source_family
from moemerge.io.reader import CheckpointReader
from moemerge.io.tensor_list import DenseTensor, write_order


def check_shapes(mine: dict[str, tuple | None], theirs: dict[str, tuple | None], label: str,
                 whose: str = "the MoE's") -> None:
    """A MismatchError naming the first tensor whose shape in the new expert (`mine`) is not
    the MoE's (`theirs`); a tensor missing on one side counts as a mismatch."""
    for name in sorted(theirs.keys() | mine.keys()):
        if mine.get(name) != theirs.get(name):
            raise MismatchError(f"{label}: tensor {name!r} is {mine.get(name) or 'missing'}, "
                                f"{whose} is {theirs.get(name) or 'missing'}: not an expert of "
                                "this MoE's base (an expert must be fine-tuned from the same "
                                "base)")


def dense_ffn_names(layout: MoELayout, config: dict) -> dict[str, str]:
    """{gate|up|down: the dense family's FFN tensor name in a layer (`mlp.gate_proj.weight`)}."""
    family, _ = source_family(layout, config)
    return {role.partition(".")[2]: rest for rest, role in family.layer_tensors.items()
            if role.startswith("ffn.")}


def check_expert(moe: CheckpointReader, layout: MoELayout, config: dict,
                 expert: CheckpointReader, label: str) -> None:
    """A new expert must be a dense model of the MoE's shapes: every shared tensor the MoE
    holds (same name and shape) and every layer's FFN of the experts' shape."""
    names = set(expert.names())
    in_block = _block_names(moe, layout, config)
    for name in moe.names():
        if name in in_block or (name == "lm_head.weight" and name not in names):
            continue  # a tied dense head is the embedding
        if name not in names or tuple(expert.meta(name).shape) != tuple(moe.meta(name).shape):
            got = tuple(expert.meta(name).shape) if name in names else "missing"
            raise MismatchError(f"{label}: tensor {name!r} is {got}, the MoE's is "
                                f"{tuple(moe.meta(name).shape)}: not an expert of this MoE's "
                                "base (an expert must be fine-tuned from the same base)")
    ffn = dense_ffn_names(layout, config)
    for layer in range(config["num_hidden_layers"]):
        for proj in PROJECTIONS:
            name = f"model.layers.{layer}.{ffn[proj]}"
            want = tuple(expert_ffn(moe, layout, layer, 0, proj)[0])
            got = tuple(expert.meta(name).shape) if name in names else "missing"
            if got != want:
                raise MismatchError(f"{label}: FFN tensor {name!r} is {got}, the MoE's experts' "
                                    f"is {want}")


def _block_names(moe: CheckpointReader, layout: MoELayout, config: dict) -> set[str]:
    from moemerge.io.moe_expert import moe_tensor_layer

    in_block = moe_tensor_layer(layout)
    return {name for name in moe.names() if in_block(name) is not None}


def extended_tensors(moe: CheckpointReader, layout: MoELayout, config: dict,
                     experts: list[CheckpointReader]) -> list[DenseTensor]:
    """Every tensor of the grown MoE, embedding first, then layer by layer."""
    old = layout.expert_count(config)
    ffn = dense_ffn_names(layout, config)
    routers = {layout.router_name(layer) for layer in range(config["num_hidden_layers"])}
    fused = {template.format(layer=layer): (layer, parts) for template, parts in
             layout.fused.items() for layer in range(config["num_hidden_layers"])}
    out: list[DenseTensor] = []
    for name in moe.names():
        meta = moe.meta(name)
        shape, dtype = tuple(meta.shape), meta.dtype
        if name in routers:  # [E + n, H] placeholder
            grown = (shape[0] + len(experts), *shape[1:])
            out.append(DenseTensor(name, dtype, grown,
                                   lambda s=grown, d=dtype: torch.zeros(s, dtype=d)))
        elif name in fused:  # [E, rows, cols] -> [E + n, rows, cols]
            layer, parts = fused[name]

            def grow(name=name, layer=layer, parts=parts, dtype=dtype) -> torch.Tensor:
                new = [torch.cat([e.read(f"model.layers.{layer}.{ffn[p]}") for p in parts])
                       for e in experts]  # each [rows, cols], its parts stacked
                return torch.cat([moe.read(name), torch.stack(new).to(dtype)])

            out.append(DenseTensor(name, dtype, (shape[0] + len(experts), *shape[1:]), grow))
        else:
            out.append(DenseTensor(name, dtype, shape, lambda n=name: moe.read(n)))
    if not layout.fused:
        for layer in range(config["num_hidden_layers"]):
            dtype = moe.meta(layout.expert_name(layer, 0, "gate")).dtype
            out.extend(_new_ffns(layout, layer, old, experts, ffn, dtype))
    return sorted(out, key=write_order)


def _new_ffns(layout: MoELayout, layer: int, first: int, experts: list[CheckpointReader],
              ffn: dict[str, str], dtype: torch.dtype) -> list[DenseTensor]:
    made = []
    for k, expert in enumerate(experts):
        for proj in PROJECTIONS:
            source = f"model.layers.{layer}.{ffn[proj]}"
            made.append(DenseTensor(layout.expert_name(layer, first + k, proj), dtype,
                                    tuple(expert.meta(source).shape),
                                    lambda e=expert, s=source: e.read(s).to(dtype)))
    return made
