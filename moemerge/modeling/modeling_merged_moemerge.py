"""Merged-experts MoE (SMEAR / Lory / CAMEx) as a transformers model (shipped with the weights).

The backbone is the base's dense model (its own transformers class); every layer's MLP is a
`MergedExpertsMLP`: for each projection p (gate, up, down) with reference E_m [O, I] and expert
weights E_i, the FFN of a token with routing scores s [N] uses

    W_p = E_m + α Σ_i s_i · Δ_i,    Δ_i = mask_i ⊙ M_i(τ_i),    τ_i = E_i − E_m.

Δ does not depend on the input: `merged_weights()` computes it once per forward for every layer
(and keeps it while the weights are unchanged and no gradient is needed). A projection is then
x E_mᵀ + α Σ_i s_i (x Δ_iᵀ): N + 1 matmuls, no per-token weight matrix.

Routing is causal, by segments of T = segment_length tokens: the tokens of segment k ≥ 1 use
softmax(router(mean hidden state of segment k − 1)); token t of segment 0 uses the router on the
mean of tokens 0..t (segment 0 "routes on itself", causally), without gradient. Cached decoding
continues exactly this routing: `MergedCache` carries, per layer, the running sum and count of
the open segment and of the last closed one, so a token generated at position p gets the scores
a full forward over the whole sequence gives position p. Means skip padding (attention_mask 0).

Tensor names: the backbone's (model.*, lm_head.weight), and per layer l under
model.layers.{l}.mlp: reference.{p}.weight (all layers, or layer 0 only when dynamic),
experts.{i}.{p}.weight, router.weight [N, H], curvature.{p}.{A,B,C,D} [N, R, d, d].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache

from .configuration_moemerge import MoemergeMergedConfig
from .curvature_moemerge import KroneckerCurvature, dare_expert_mask, ties_mask
from .pretrained_moemerge import (
    CACHE,
    MoemergeModel,
    causal_lm_output,
    checkpointing,
    dense_config,
    ffn_activation,
    given_cache,
)

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class FFNWeights(nn.Module):
    """gate_proj, up_proj [I, H] and down_proj [H, I] of one FFN, as plain Linear layers."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


class SegmentState:
    """One layer's routing state between forwards: the sums [B, H] and token counts [B, 1] of
    the open segment (the one the next token falls in) and of the last closed segment."""

    def __init__(self, open_sum, open_count, closed_sum=None, closed_count=None):
        self.open_sum, self.open_count = open_sum, open_count
        self.closed_sum, self.closed_count = closed_sum, closed_count

    def map(self, fn) -> SegmentState:
        """The same state with `fn` applied to every tensor along the batch axis."""
        return SegmentState(*(fn(t) if t is not None else None for t in
                              (self.open_sum, self.open_count, self.closed_sum,
                               self.closed_count)))


class MergedCache(DynamicCache):
    """The backbone's KV cache plus each layer's segment-routing state."""

    def __init__(self, config):
        try:
            super().__init__(config=config)  # transformers 5
        except TypeError:
            super().__init__()  # transformers 4
        self.segments: dict[int, SegmentState] = {}

    def _map(self, fn) -> None:
        self.segments = {layer: state.map(fn) for layer, state in self.segments.items()}

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self._map(lambda t: t.repeat_interleave(repeats, 0))

    def batch_select_indices(self, indices):
        super().batch_select_indices(indices)
        self._map(lambda t: t[indices])

    def crop(self, max_length: int):
        raise NotImplementedError("a merged-experts cache keeps segment sums that cannot be "
                                  "cropped (assisted / speculative decoding is not supported)")


class Step:
    """What one forward shares with every layer's MLP: merged weights, cache, padding mask."""

    # per layer: ({p: E_m}, {p: Δ [N, O, I]}), or None: the layer makes its own
    weights: list | None = None
    cache: MergedCache | None = None
    offset = 0  # position of the first input token: the tokens already in the cache
    mask: torch.Tensor | None = None  # [B, T] attention mask (1 = token)


class MergedExpertsMLP(nn.Module):
    def __init__(self, config: MoemergeMergedConfig, dense, layer: int, step: Step, act):
        super().__init__()
        hidden, inter, n = dense.hidden_size, dense.intermediate_size, config.num_experts
        self.layer, self.step, self.config = layer, step, config
        self.reference = None if config.dynamic and layer > 0 else FFNWeights(hidden, inter)
        self.experts = nn.ModuleList(FFNWeights(hidden, inter) for _ in range(n))
        self.router = nn.Linear(hidden, n, bias=False)
        self.curvature = None
        if config.curvature == "kronecker":
            shapes = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
                      "down_proj": (hidden, inter)}
            self.curvature = nn.ModuleDict({p: KroneckerCurvature(n, o, i, config.curvature_rank)
                                            for p, (o, i) in shapes.items()})
        self.act = act  # the dense family's own activation module

    def deltas(self, reference: dict) -> tuple[dict, dict]:
        """({p: M_i τ_i [N, O, I]}, {p: Δ_i = mask ⊙ M_i τ_i}) for this layer."""
        curved, masked = {}, {}
        for p in PROJECTIONS:
            tau = torch.stack([getattr(e, p).weight for e in self.experts]) - reference[p]
            curved[p] = self.curvature[p](tau) if self.curvature is not None else tau
            masked[p] = curved[p] * ties_mask(curved[p]) if self.config.mask == "ties" \
                else curved[p]
        return curved, masked

    def scores(self, h: torch.Tensor) -> torch.Tensor:
        """Routing scores of the input tokens: h [B, T, H] at positions offset.. -> s [B, T, N].

        Local segment j holds the tokens of segment first + j (first = offset // T); the open
        segment's earlier tokens come from the cache's state, added to local segment 0."""
        step, size = self.step, self.config.segment_length
        b, t, width = h.shape
        state = step.cache.segments.get(self.layer) if step.cache is not None else None
        if step.offset and state is None:
            raise ValueError("merged-experts decoding needs the MergedCache of the earlier "
                             "tokens (their segment sums route the next ones)")
        mask = (step.mask[:, -t:] if step.mask is not None else h.new_ones(b, t))[..., None]
        mask = mask.to(h.dtype)
        first = step.offset // size
        segment = (torch.arange(t, device=h.device) + step.offset) // size - first  # [T] local
        k = int(segment[-1]) + 1
        sums = h.new_zeros(b, k, width).index_add(1, segment, h * mask)  # [B, K, H]
        counts = h.new_zeros(b, k, 1).index_add(1, segment, mask)  # [B, K, 1]
        if state is not None:
            carried = F.pad(state.open_sum[:, None], (0, 0, 0, k - 1))
            sums = sums + carried
            counts = counts + F.pad(state.open_count[:, None], (0, 0, 0, k - 1))
        means = sums / counts.clamp_min(1.0)
        if first > 0:  # local segment 0 is routed by the last closed segment
            closed = state.closed_sum / state.closed_count.clamp_min(1.0)
            previous = torch.cat([closed[:, None].to(h.dtype), means[:, :-1]], dim=1)
            scores = torch.softmax(self.router(previous), -1)[:, segment]  # [B, T, N]
        else:  # segment 0: running mean of its tokens so far, no gradient
            n0 = int((segment == 0).sum())
            run_sum = (h[:, :n0] * mask[:, :n0]).cumsum(1)
            run_count = mask[:, :n0].cumsum(1)
            if state is not None:
                run_sum = run_sum + state.open_sum[:, None]
                run_count = run_count + state.open_count[:, None]
            running = run_sum / run_count.clamp_min(1.0)  # [B, n0, H]
            head = torch.softmax(self.router(running.detach()), -1).detach()
            rest = torch.softmax(self.router(means[:, :-1]), -1)  # [B, K − 1, N]
            scores = torch.cat([head, rest[:, segment[n0:] - 1]], dim=1)
        if self.training and self.config.mask == "dare":
            drop = dare_expert_mask((b, k, scores.shape[-1]), self.config.dare_p, h.device)
            scores = scores * drop[:, segment]
        if step.cache is not None:
            step.cache.segments[self.layer] = self._next_state(state, sums, counts, first,
                                                               step.offset + t)
        return scores

    def _next_state(self, state, sums, counts, first: int, end: int) -> SegmentState:
        """The state after the tokens before position `end`: local segment j = end // T − first
        is the new open one (empty when `end` starts it), j − 1 the new closed one."""
        j = end // self.config.segment_length - first
        sums, counts = sums.detach(), counts.detach()
        if j < sums.shape[1]:
            open_sum, open_count = sums[:, j], counts[:, j]
        else:
            open_sum, open_count = torch.zeros_like(sums[:, 0]), torch.zeros_like(counts[:, 0])
        if j == 0:  # still in the same segment: the closed one is unchanged
            return SegmentState(open_sum, open_count, state.closed_sum if state else None,
                                state.closed_count if state else None)
        return SegmentState(open_sum, open_count, sums[:, j - 1], counts[:, j - 1])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        weights = self.step.weights[self.layer]
        if weights is None:  # made here, inside the layer's checkpoint (merged_weights)
            reference = {p: getattr(self.reference, p).weight for p in PROJECTIONS}
            weights = (reference, self.deltas(reference)[1])
        reference, delta = weights
        s = self.scores(h).to(h.dtype)
        alpha = self.config.alpha

        def project(x: torch.Tensor, p: str) -> torch.Tensor:
            per_expert = torch.einsum("bti,noi->btno", x, delta[p].to(x.dtype))  # x Δ_iᵀ
            return F.linear(x, reference[p]) + alpha * torch.einsum("btn,btno->bto", s, per_expert)

        return project(self.act(project(h, "gate_proj")) * project(h, "up_proj"), "down_proj")


class MoemergeMergedForCausalLM(MoemergeModel, PreTrainedModel, GenerationMixin):
    config_class = MoemergeMergedConfig
    base_model_prefix = "moemerge_merged"

    def __init__(self, config: MoemergeMergedConfig):
        super().__init__(config)
        config.check()
        self.dense_config = dense_config(config.base, getattr(config, "_attn_implementation",
                                                              None))
        self.model = AutoModel.from_config(self.dense_config)
        self.step = Step()
        for index, layer in enumerate(self.model.layers):
            layer.mlp = MergedExpertsMLP(config, self.dense_config, index, self.step,
                                         ffn_activation(layer.mlp))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._no_split_modules = [type(self.model.layers[0]).__name__]  # device_map="auto"
        self._frozen: tuple | None = None  # (weight versions, merged weights) without grad
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def mlps(self) -> list[MergedExpertsMLP]:
        return [layer.mlp for layer in self.model.layers]

    def merged_weights(self, lazy: bool = False) -> list[tuple[dict, dict] | None]:
        """Per layer ({p: E_m [O, I]}, {p: Δ [N, O, I]}), layer by layer since a dynamic layer's
        E_m comes from the one below: E_m^{l+1} = E_m^l + α · mean_i M_i τ_i^l.

        `lazy` (training with gradient checkpointing): a static model's layers get None, and
        each makes its own inside its checkpointed forward, so the graph of Δ (several
        [N, O, I] tensors per projection) lives one layer at a time, not every layer's until
        the backward pass. A dynamic model's E_m chain runs through every layer below, so its
        Δ are made here."""
        if lazy and not self.config.dynamic:
            return [None] * len(self.mlps())
        params = [p for mlp in self.mlps() for p in mlp.parameters()]
        key = tuple(p._version for p in params) + tuple(p.data_ptr() for p in params)
        if not torch.is_grad_enabled() and self._frozen is not None and self._frozen[0] == key:
            return self._frozen[1]
        weights, reference = [], None
        for mlp in self.mlps():
            if mlp.reference is not None:
                reference = {p: getattr(mlp.reference, p).weight for p in PROJECTIONS}
            curved, masked = mlp.deltas(reference)
            weights.append((reference, masked))
            reference = {p: reference[p] + self.config.alpha * curved[p].mean(0)
                         for p in PROJECTIONS}
        self._frozen = (key, weights) if not torch.is_grad_enabled() else None
        return weights

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0,
                past_key_values=None, **kwargs):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        cache = given_cache(cache, past_key_values)
        if use_cache and cache is None:
            cache = MergedCache(self.dense_config)
        step = self.step
        step.weights = self.merged_weights(
            lazy=self.training and checkpointing(self) and torch.is_grad_enabled())
        step.cache = cache if isinstance(cache, MergedCache) else None
        step.offset = cache.get_seq_length() if cache is not None else 0
        step.mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 \
            else None
        try:
            out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds,
                             attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=use_cache, **{CACHE: cache}, **kwargs)
        finally:
            # weights and mask stay: with gradient checkpointing the backward pass runs the
            # layers again; the cache does not (it would outlive generation)
            step.cache = None
        return causal_lm_output(self.lm_head, self.dense_config, out, labels, logits_to_keep,
                                use_cache)

    @torch.no_grad()
    def baked_experts(self) -> dict[str, torch.Tensor]:
        """Expert weights with the curvature folded in, E'_i = E_m + M_i τ_i, by tensor name:
        with curvature none the same model computes the same outputs."""
        out, weights = {}, self.merged_weights()
        for index, mlp in enumerate(self.mlps()):
            reference = weights[index][0]
            curved, _ = mlp.deltas(reference)
            for p in PROJECTIONS:
                for i, tau in enumerate(curved[p]):
                    name = f"model.layers.{index}.mlp.experts.{i}.{p}.weight"
                    out[name] = reference[p] + tau
        return out
