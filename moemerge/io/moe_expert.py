"""A token-routed MoE's expert as a dense model of the family it was built from.

The MoE's non-FFN tensors (attention, norms, embedding, head: the merged ones every expert
shares) are copied under their own names; each layer's FFN is that expert's gate / up / down
[I, H] / [I, H] / [H, I]. An MoE forced to one expert (top-k weights renormalised to 1.0)
computes exactly this. Shared experts: Qwen2-MoE's zeroed one (shared_expert: none) adds 0
and is dropped; GraniteMoeShared's ungated shared MLP is concatenated along the intermediate
axis (FFN_e(x) + FFN_s(x) is one FFN of width I_e + I_s); a gated non-zero one
(sigmoid(g . x) FFN_s(x)) has no dense equivalent and is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from moemerge.architectures.config import COPIED, dtype_name, rope_keys
from moemerge.architectures.forms import layout_of, name_pattern
from moemerge.architectures.tables import DenseFamily, MoELayout, dense_families
from moemerge.errors import CheckpointError, MismatchError
from moemerge.io.reader import CheckpointReader, DerivedReader, TensorMeta
from moemerge.io.tensor_list import DenseTensor, Extraction, resolve_tie

PROJECTIONS = ("gate", "up", "down")
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def source_family(layout: MoELayout, config: dict) -> tuple[DenseFamily, str]:
    """(family, model_type) the MoE was built from. Llama and Mistral both become Mixtral: a
    Mistral config carries `sliding_window` (null or a size), which build copies and a Llama
    config never has."""
    family = next((f for f in dense_families().values()
                   if layout.name in (f.moe_target, f.shared_target)), None)
    if family is None:
        twins = sorted({lay for f in dense_families().values()
                        for lay in (f.moe_target, f.shared_target) if lay})
        raise MismatchError(
            f"{layout.name} ({layout.architecture}): no dense model family in moemerge's tables "
            "has its attention and norms, so no dense transformers model computes one of its "
            f"experts exactly; experts are extracted from {', '.join(twins)} MoEs. Its experts "
            "can still be shrunk, merged, fine-tuned, or taken into a recipe as experts of an "
            "MoE of this family")
    if len(family.model_types) > 1:
        return family, "mistral" if "sliding_window" in config else "llama"
    return family, family.model_types[0]


def dense_config(config: dict, layout: MoELayout, model_type: str, width: int) -> dict:
    """The inverse of architectures/config.moe_config: the source keys it copied, the family's
    own class, and intermediate_size = the extracted FFN's width."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    dense = {"architectures": [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]],
             "model_type": model_type}
    dense.update({k: config[k] for k in (*COPIED, *layout.copied_config) if k in config})
    dense.update(rope_keys(config), intermediate_size=width)
    dense["torch_dtype"] = config.get("torch_dtype", dtype_name(torch.float32))
    return dense


def moe_tensor_layer(layout: MoELayout) -> Callable[[str], int | None]:
    """name -> its layer if it belongs to a layer's sparse block (experts, router, shared
    expert, fused tensors), else None."""
    templates = [layout.expert, layout.router, *layout.fused, *layout.fused_shared,
                 *(t for t in (layout.shared_expert, layout.shared_expert_gate) if t)]
    patterns = [name_pattern(t) for t in templates]

    def layer(name: str) -> int | None:
        found = next((m for p in patterns if (m := p.fullmatch(name))), None)
        return int(found["layer"]) if found else None

    return layer


Part = tuple[tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]  # shape, dtype, read


def _fused_part(reader: CheckpointReader, fused: dict, layer: int, proj: str,
                expert: int | None) -> Part | None:
    """`proj` sliced out of a fused tensor ([E, rows, cols] per expert, or [rows, cols] for
    the shared MLP; its rows are its parts' rows, stacked in order, of equal widths)."""
    for template, parts in fused.items():
        if proj in parts and (name := template.format(layer=layer)) in reader:
            meta = reader.meta(name)
            rows, cols = meta.shape[-2:]
            step, at = rows // len(parts), parts.index(proj) * (rows // len(parts))

            def read(name=name, at=at, step=step) -> torch.Tensor:
                whole = reader.read(name)
                return (whole if expert is None else whole[expert])[at:at + step]

            return (step, cols), meta.dtype, read
    return None


def expert_ffn(reader: CheckpointReader, layout: MoELayout, layer: int, expert: int,
               proj: str) -> Part:
    """One expert's projection: its own tensor, or its slice of a fused one."""
    fused = _fused_part(reader, layout.fused, layer, proj, expert)
    if fused is not None:
        return fused
    name = layout.expert_name(layer, expert, proj)
    meta = reader.meta(name)
    return meta.shape, meta.dtype, lambda: reader.read(name)


def shared_ffn(reader: CheckpointReader, layout: MoELayout, layer: int, proj: str
               ) -> Part | None:
    """The shared expert's projection when it must be added (DeepSeek-MoE's and
    GraniteMoeShared's, ungated),
    None when it adds nothing (a zeroed one behind a gate); refuses a gated non-zero one."""
    if layout.shared_expert is None or (layout.shared_count_key is not None
                                        and layout.shared_name(layer, proj) not in reader):
        return None  # (DeepSeek-MoE may have none)
    part = _fused_part(reader, layout.fused_shared, layer, proj, None)
    if part is None:
        name = layout.shared_name(layer, proj)
        meta = reader.meta(name)
        part = meta.shape, meta.dtype, lambda: reader.read(name)
    if layout.shared_expert_gate is None:
        return part
    if torch.count_nonzero(part[2]()):
        raise MismatchError(
            f"layer {layer}: this {layout.model_type} MoE has a non-zero shared expert (recipe "
            "shared_expert: base or average), added as sigmoid(g . x) * FFN_s(x); no dense "
            "model computes that gate, so none of its experts can be extracted exactly. Only "
            "MoEs built with shared_expert: none can be.")
    return None


def layer_ffn(reader: CheckpointReader, layout: MoELayout, layer: int, expert: int,
              proj: str) -> Part:
    """The dense projection: the expert's, joined with an ungated shared MLP's along the
    intermediate axis (gate / up [I, H]: rows; down [H, I]: columns)."""
    shape, dtype, read = expert_ffn(reader, layout, layer, expert, proj)
    shared = shared_ffn(reader, layout, layer, proj)
    if shared is None:
        return shape, dtype, read
    axis = 1 if proj == "down" else 0
    grown = list(shape)
    grown[axis] += shared[0][axis]
    return tuple(grown), dtype, lambda: torch.cat([read(), shared[2]()], axis)


def extract_token_routed(reader: CheckpointReader, config: dict, expert: int,
                         label: str) -> Extraction:
    layout = layout_of(config)
    family, model_type = source_family(layout, config)
    ffn_names = {role.partition(".")[2]: rest for rest, role in family.layer_tensors.items()
                 if role.startswith("ffn.")}
    missing = set(PROJECTIONS) - set(ffn_names)
    if missing:
        raise CheckpointError(f"{family.name}: no dense FFN tensor for {sorted(missing)}")
    in_block = moe_tensor_layer(layout)
    extraction, done = Extraction({}), set()
    width = 0
    for name in reader.names():
        layer = in_block(name)
        if layer is None:
            extraction.copy(reader, name)
        elif layer not in done:
            done.add(layer)
            for proj in PROJECTIONS:
                shape, dtype, read = layer_ffn(reader, layout, layer, expert, proj)
                width = shape[1] if proj == "down" else shape[0]
                own = layout.expert_name(layer, expert, proj)  # (the same bytes, or made)
                plain = own in reader and reader.meta(own).shape == tuple(shape)
                extraction.tensors.append(DenseTensor(
                    f"model.layers.{layer}.{ffn_names[proj]}", dtype, tuple(shape), read,
                    source=own if plain else None))
    if len(done) != config.get("num_hidden_layers", len(done)):
        raise CheckpointError(f"{len(done)} sparse blocks for num_hidden_layers "
                              f"{config.get('num_hidden_layers')}")
    extraction.config = dense_config(config, layout, model_type, width)
    if config.get("tie_word_embeddings"):  # the MoE computes its head from the embedding
        extraction.tensors = [t for t in extraction.tensors if t.name != HEAD]
    resolve_tie(extraction, reader, EMBED, HEAD)
    extraction.what = (f"expert {expert} ({label!r}): its FFN in every layer, with the MoE's "
                       f"shared attention, norms, embedding and head ({layout.architecture} -> "
                       f"{extraction.config['architectures'][0]})")
    return extraction


class ExpertReader(DerivedReader):
    """Expert `expert` of a token-routed MoE read as a dense checkpoint of its source family
    (the recipe's `{model: moe, expert: N}`): what `extract` writes, without writing it. Its
    FFN tensors are the expert's own bytes under dense names (copied as bytes where nothing
    changes them), the rest the MoE's; a GraniteMoeShared expert joined with the shared MLP is
    made when read. The MoE's reader is closed by its owner."""

    whose = "'s expert"

    def __init__(self, moe: CheckpointReader, expert: int, label: str):
        layout = layout_of(moe.config)
        where = f"{label} ({moe.directory})"
        if layout is None:
            raise CheckpointError(f"{where}: `expert: {expert}` takes an expert of a token-routed "
                                  f"MoE, and model_type {moe.config.get('model_type')!r} is not "
                                  "one (seq_routed and merged_experts experts: moemerge extract)")
        count = layout.expert_count(moe.config)
        if expert >= count:
            raise CheckpointError(f"{where}: expert: {expert}, but it has {count} experts per "
                                  f"layer (0 to {count - 1})")
        extraction = extract_token_routed(moe, moe.config, expert, label)
        self.moe, self.directory, self.config = moe, moe.directory, extraction.config
        self.form, self.allow_pickle = None, moe.allow_pickle
        self._tensors = {t.name: t for t in extraction.tensors}
        self.metas = {name: (replace(moe.meta(t.source), name=name) if t.source is not None
                             else TensorMeta(name, t.dtype, t.shape, moe.directory))
                      for name, t in self._tensors.items()}
        self.on_disk = self.metas

    def stored(self, name: str) -> TensorMeta | None:
        source = self._tensors[name].source
        return None if source is None or self.moe.stored(source) is None else self.meta(name)

    def read(self, name: str) -> torch.Tensor:
        return self._tensors[name].make()
