"""A merged-experts (SMEAR / Lory / CAMEx) MoE at fixed routing scores, as a dense model.

Its FFN for a token with scores s [N] (modeling_merged_moemerge.py) is, per projection,
W_p = E_m + α Σ_i s_i Δ_i with Δ_i = mask_i ⊙ M_i(τ_i): Δ does not depend on the input, so
at scores s held fixed for every token and layer W_p is one dense weight and the model is the
base's dense family exactly. `--expert i` is s = one-hot(i) (E_m + α Δ_i: expert i as the
MoE applies it, masks and curvature included, which is E_i itself only with α = 1, no
curvature and no mask); `--weights` any s (normalised to sum 1, as the softmax router's).

Streams one layer at a time: the layer's MLP is rebuilt from the installed modeling code
(`MergedExpertsMLP.deltas`, so the TIES-CA mask and curvature are computed by the same code
the model runs), its E_m carried up the layers when the model is dynamic.
"""

from __future__ import annotations

import torch

from moemerge.architectures.config import dense_config
from moemerge.built.extract.choice import one_hot
from moemerge.errors import CheckpointError
from moemerge.io.reader import CheckpointReader
from moemerge.io.tensor_list import DenseTensor, Extraction, config_dtype, resolve_tie
from moemerge.modeling.configuration_moemerge import MoemergeMergedConfig
from moemerge.modeling.modeling_merged_moemerge import PROJECTIONS, MergedExpertsMLP
from moemerge.modeling.pretrained_moemerge import dense_config as dense_config_object

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


class MergedFFNs:
    """The dense FFN weights of every layer at scores `s`, computed layer by layer on demand
    (the writer asks in layer order; a dynamic E_m needs the layers below)."""

    def __init__(self, reader: CheckpointReader, config: dict, scores: list[float]):
        self.reader, self.scores = reader, torch.tensor(scores, dtype=torch.float32)
        self.config = MoemergeMergedConfig(**{k: v for k, v in config.items()
                                              if k not in ("architectures", "auto_map")})
        self.dense = dense_config_object(self.config.base, None)
        self.reference: dict[str, torch.Tensor] | None = None
        self.done: dict[int, dict[str, torch.Tensor]] = {}

    def weight(self, layer: int, proj: str) -> torch.Tensor:
        while layer not in self.done:
            self._next_layer(len(self.done))
        return self.done[layer].pop(proj)  # each is written once; free it

    @torch.no_grad()
    def _next_layer(self, layer: int) -> None:
        mlp = MergedExpertsMLP(self.config, self.dense, layer, step=None, act=None)
        prefix = f"model.layers.{layer}.mlp."
        state = {n: self.reader.read(prefix + n).float() for n in mlp.state_dict()}
        mlp.load_state_dict(state)
        if mlp.reference is not None:
            self.reference = {p: getattr(mlp.reference, p).weight for p in PROJECTIONS}
        curved, masked = mlp.deltas(self.reference)  # [N, O, I] each
        alpha = self.config.alpha
        self.done[layer] = {p: self.reference[p] + alpha * torch.einsum(
            "n,noi->oi", self.scores, masked[p]) for p in PROJECTIONS}
        # what the model carries to the next layer (used there only when dynamic)
        self.reference = {p: self.reference[p] + alpha * curved[p].mean(0) for p in PROJECTIONS}


def extract_merged(reader: CheckpointReader, config: dict, scores: list[float],
                   label: str) -> Extraction:
    if not isinstance(config.get("base"), dict):
        raise CheckpointError("a merged-experts config.json needs its `base` dense config")
    ffns = MergedFFNs(reader, config, scores)
    base = config["base"]
    extraction = Extraction(dense_config(base, config_dtype(base)))
    layers = int(base["num_hidden_layers"])
    for name in reader.names():
        if ".mlp." not in name:
            extraction.copy(reader, name)
    for layer in range(layers):
        for proj in PROJECTIONS:
            meta = reader.meta(f"model.layers.{layer}.mlp.experts.0.{proj}.weight")
            extraction.tensors.append(DenseTensor(
                f"model.layers.{layer}.mlp.{proj}.weight", meta.dtype, meta.shape,
                lambda layer=layer, proj=proj: ffns.weight(layer, proj)))
    resolve_tie(extraction, reader, EMBED, HEAD)
    extraction.what = (f"{label} of a merged-experts MoE: every FFN merged at routing scores "
                       f"s = [{', '.join(f'{s:.4g}' for s in scores)}] (W = E_m + α Σ s_i Δ_i, "
                       f"α = {config.get('alpha', 1.0):g}), with its attention, norms, "
                       "embedding and head")
    return extraction



def extract_merged_expert(reader: CheckpointReader, config: dict, expert: int,
                          label: str) -> Extraction:
    """Expert `expert` alone: the merged FFNs at the one-hot scores."""
    return extract_merged(reader, config, one_hot(expert, config["num_experts"]), label)
