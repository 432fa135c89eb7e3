"""moemerge's sequence-routed MoE kinds as a transformers model (shipped next to the weights).

Every expert is the dense model it came from (`AutoModel.from_config` of its own config, so a
Llama expert runs Llama's code), minus the embedding and head when those are shared:

    ids ─ embed (shared [V, d_m], or the expert's own) ─ proj_in? (d_m → d_i) ─ decoder layers
        ─ final norm ─ proj_out? (d_i → d_m) ─ head (shared, or the expert's own) ─ logits

Sequence b goes to the experts of row b of the routing weights W [B, N] (routing_moemerge.py);
their next-token distributions are mixed, log Σ_e W[b, e] softmax(z_e), or (mix="hidden") their
final hidden states are mixed before the shared head. With k = 1 the chosen expert's own logits
are returned unchanged. In training mode a learned router mixes all N experts (a dense soft
mixture, so the LM loss reaches every router row); in eval mode it keeps the top k.

Tensor names: embed_tokens.weight, lm_head.weight, router.weight [N, d_m],
experts.{e}.model.* (the dense model's `model.*` tensors), experts.{e}.lm_head.weight,
experts.{e}.proj_{in,out}.{linear,up,down}.weight, base.* (task_vector routing only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    GenerationMixin,
    PreTrainedModel,
)
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_moemerge import MoemergeConfig
from .pretrained_moemerge import (
    CACHE,
    MoemergeModel,
    dense_config,
    embedding_scale,
    given_cache,
    scale_embeddings,
    softcap_logits,
)
from .routing_moemerge import (
    RoutedCache,
    TaskVectorScorer,
    mean_embedding,
    perplexity_scores,
    rms_normalise,
    sequence_nll,
    topk_weights,
)


@dataclass
class MoemergeCausalLMOutput(CausalLMOutputWithPast):
    """CausalLMOutputWithPast plus the routing: weights [B, N] and (learned router) logits."""

    routing_weights: torch.Tensor | None = None
    router_logits: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def new_cache(config) -> DynamicCache:
    try:
        return DynamicCache(config=config)  # transformers 5: layer types from the config
    except TypeError:
        return DynamicCache()  # transformers 4


class Projector(nn.Module):
    """d_in -> d_out: a linear map plus an MLP branch, y = L x + D silu(U x). Identity-like init
    (L selects/pads the first min(d_in, d_out) coordinates, D = 0) reproduces the expert."""

    def __init__(self, d_in: int, d_out: int, hidden: int):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=False)
        self.up = nn.Linear(d_in, hidden, bias=False) if hidden else None
        self.down = nn.Linear(hidden, d_out, bias=False) if hidden else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y + self.down(F.silu(self.up(x))) if self.up is not None else y


class ExpertStack(nn.Module):
    """One expert: [proj_in] → its decoder layers and final norm → [proj_out] (+ own head)."""

    def __init__(self, config: MoemergeConfig, index: int):
        super().__init__()
        dense = dense_config(config.experts[index], getattr(config, "_attn_implementation", None))
        self.model = AutoModel.from_config(dense)
        self.embed_scale = None  # what the expert's own embedding multiplied rows by
        if config.shared_embeddings:
            self.embed_scale = embedding_scale(self.model.embed_tokens)
            self.model.embed_tokens = None
        width, bridged = dense.hidden_size, config.assembly == "bridged"
        hidden = config.projector_hidden_size
        self.proj_in = Projector(config.hidden_size, width, hidden) if bridged else None
        self.proj_out = Projector(width, config.hidden_size, hidden) if bridged else None
        self.lm_head = None if config.shared_lm_head else nn.Linear(width, config.vocab_size,
                                                                    bias=False)

    def forward(self, input_ids, embeds, attention_mask, position_ids, cache):
        """-> (final hidden states [B, T, d_m or d_e], the expert's KV cache)."""
        if embeds is not None and self.proj_in is not None:
            embeds = self.proj_in(embeds)
        if embeds is not None:  # the projector maps to the expert's unscaled embedding space
            embeds = scale_embeddings(embeds, self.embed_scale)
        out = self.model(input_ids=None if embeds is not None else input_ids,
                         inputs_embeds=embeds, attention_mask=attention_mask,
                         position_ids=position_ids, use_cache=cache is not None,
                         **{CACHE: cache})
        hidden = out.last_hidden_state
        return (self.proj_out(hidden) if self.proj_out is not None else hidden,
                getattr(out, CACHE))


class MoemergePreTrainedModel(MoemergeModel, PreTrainedModel):
    config_class = MoemergeConfig
    base_model_prefix = "moemerge"


class MoemergeForCausalLM(MoemergePreTrainedModel, GenerationMixin):
    def __init__(self, config: MoemergeConfig):
        super().__init__(config)
        config.check()
        d_m, vocab = config.hidden_size, config.vocab_size
        self.embed_tokens = nn.Embedding(vocab, d_m) if config.shared_embeddings else None
        self.lm_head = nn.Linear(d_m, vocab, bias=False) if config.shared_lm_head else None
        self.router = nn.Linear(d_m, config.num_experts, bias=False)
        self.experts = nn.ModuleList(ExpertStack(config, i) for i in range(config.num_experts))
        caps = {getattr(e.model.config, "final_logit_softcapping", None) for e in self.experts}
        if config.mix == "hidden" and len(caps) > 1:
            raise ValueError(f"mix: 'hidden' puts one head on the mixed states, but the experts "
                             f"softcap their logits differently ({sorted(caps, key=str)})")
        self.base = None
        if config.base is not None:
            attn = getattr(config, "_attn_implementation", None)
            self.base = AutoModelForCausalLM.from_config(dense_config(config.base, attn))
        self._scorer = None
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens if self.embed_tokens is not None else \
            self.experts[0].model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head if self.lm_head is not None else self.experts[0].lm_head

    # --- routing -----------------------------------------------------------------------------

    def _embeds(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B, T, d_m] the router reads: the shared embedding, or the mean of
        the experts' own embeddings when each keeps its own."""
        if self.embed_tokens is not None:
            return self.embed_tokens(input_ids)
        return torch.stack([e.model.embed_tokens(input_ids) for e in self.experts]).mean(0)

    def router_input(self, input_ids, attention_mask=None) -> torch.Tensor:
        """What the learned router reads: the mean token embedding [B, d_m], RMS-normalised
        unless the config says "mean_embedding" (checkpoints written before the key)."""
        mean = mean_embedding(self._embeds(input_ids), attention_mask)
        if self.config.router_input == "rms_mean_embedding":
            mean = rms_normalise(mean).to(mean.dtype)
        return mean

    def route(self, input_ids, attention_mask=None, run=None):
        """-> (W [B, N], router logits [B, N] or None, {expert: (hidden, cache)} already run)."""
        config, done = self.config, {}
        k = config.num_experts_per_seq
        if config.router == "learned":
            logits = self.router(self.router_input(input_ids, attention_mask))
            k = config.num_experts if self.training else k
            return topk_weights(logits, k, config.routing_temperature), logits, done
        if config.router == "perplexity":
            nll = []
            for e in range(config.num_experts):
                done[e] = run(e)
                with torch.no_grad():  # a choice, not a function to differentiate
                    nll.append(sequence_nll(self._head(e, done[e][0]), input_ids,
                                            attention_mask))
            scores = perplexity_scores(torch.stack(nll), config.perplexity_score)
        else:
            if self._scorer is None:
                self._scorer = TaskVectorScorer(self.base, list(self.experts),
                                                config.task_vector_params)
            scores = self._scorer(input_ids, attention_mask)
        return topk_weights(scores, k, config.routing_temperature), None, done

    # --- forward -----------------------------------------------------------------------------

    def _head(self, e: int, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head if self.lm_head is not None else self.experts[e].lm_head
        return softcap_logits(head(hidden), self.experts[e].model.config)

    def _mix(self, weights: torch.Tensor, hidden: dict, keep: slice) -> torch.Tensor:
        """Mixed logits [B, T', V] of the experts in `hidden` ({e: [B, T, d]}), weights [B, N]."""
        active = sorted(hidden)
        if self.config.mix == "hidden":
            mixed = sum(weights[:, e, None, None].to(hidden[e].dtype) * hidden[e][:, keep]
                        for e in active)
            return softcap_logits(self.lm_head(mixed), self.experts[0].model.config)
        logits = {e: self._head(e, hidden[e][:, keep]) for e in active}
        if (weights > 0).sum(-1).max() == 1:  # k = 1: each row's own expert, unchanged
            out = torch.zeros_like(logits[active[0]])
            for e in active:
                out = torch.where(weights[:, e, None, None] > 0, logits[e], out)
            return out
        # log Σ_e W[b, e] softmax(z_e): log-probabilities, a valid set of logits
        log_w = torch.log(weights[:, active]).T[..., None, None]  # [E', B, 1, 1]; log 0 = -inf
        log_p = torch.stack([F.log_softmax(logits[e].float(), dim=-1) for e in active])
        return torch.logsumexp(log_w + log_p, dim=0).to(logits[active[0]].dtype)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, output_router_logits=False,
                logits_to_keep=0, past_key_values=None, **kwargs):
        if input_ids is None:
            raise ValueError("moemerge sequence-routed models take input_ids (routing reads the "
                             "tokens), not inputs_embeds")
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        cache = given_cache(cache, past_key_values)
        cached = cache if isinstance(cache, RoutedCache) else None
        embeds = self.embed_tokens(input_ids) if self.embed_tokens is not None else None

        def run(e):
            cache = cached.caches.get(e) if cached is not None else None
            if use_cache and cache is None:
                cache = new_cache(self.experts[e].model.config)
            return self.experts[e](input_ids, embeds, attention_mask, position_ids, cache)

        router_logits = None
        if cached is not None:  # generation after the prompt: keep the prompt's routing
            weights, outputs = cached.weights, {}
        else:
            weights, router_logits, outputs = self.route(input_ids, attention_mask, run)
        active = [e for e in range(self.config.num_experts) if bool((weights[:, e] > 0).any())]
        outputs = {e: outputs[e] if e in outputs else run(e) for e in active}
        keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        logits = self._mix(weights, {e: h for e, (h, _) in outputs.items()}, keep)

        cache = None
        if use_cache:
            cache = cached or RoutedCache(weights, {})
            cache.caches.update({e: c for e, (_, c) in outputs.items() if c is not None})
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        aux = self._balance_loss(weights, router_logits) if output_router_logits else None
        return MoemergeCausalLMOutput(loss=loss, logits=logits, routing_weights=weights,
                                      router_logits=router_logits, aux_loss=aux,
                                      **{CACHE: cache})

    def _balance_loss(self, weights, router_logits):
        """Switch load balancing over sequences: N Σ_e f_e P_e (f: share of sequences that go
        to e, P: mean router probability of e). None for routers that are not learned."""
        if router_logits is None:
            return None
        n = self.config.num_experts
        chosen = router_logits.topk(self.config.num_experts_per_seq, dim=-1).indices
        f = F.one_hot(chosen, n).float().sum(1).mean(0) / self.config.num_experts_per_seq
        return n * (f * torch.softmax(router_logits.float(), -1).mean(0)).sum()
