"""What moemerge's shipped model classes share (shipped next to the weights): a dense expert's
config from its config.json dict, and strict loading.

Every shipped module imports its moemerge neighbours directly: transformers 4 copies only the
files a remote-code module imports itself, not what those import in turn.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

# The name transformers gives the KV cache, as a forward keyword and as an output field:
# `cache` from 5.24 on (where `past_key_values` warns, and goes in 5.40), `past_key_values`
# before. Shipped code passes and reads the cache by this name only, so it runs warning-free on
# every release, and accepts either name from its own callers.
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def checkpointing(model) -> bool:
    """Whether `model` trains with activation (gradient) checkpointing: transformers 5's
    `is_activation_checkpointing` (its `is_gradient_checkpointing` warns and goes in v6),
    transformers 4's `is_gradient_checkpointing`."""
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    return bool(getattr(model, name))


def given_cache(cache, past_key_values):
    """The cache a caller passed by either name (generate() passes `cache` from 5.24 on)."""
    return cache if cache is not None else past_key_values


def dense_config(values: dict, attn_implementation: str | None):
    """A dense expert's transformers config from its config.json dict (classic keys accepted)."""
    # no dtype: the submodel takes the one the outer model is loaded or built in
    values = {k: v for k, v in values.items()
              if k not in ("architectures", "auto_map", "torch_dtype", "dtype")}
    config = AutoConfig.for_model(**values)
    config.tie_word_embeddings = False  # heads are separate tensors here
    if attn_implementation and _can_run(config, attn_implementation):
        config._attn_implementation = attn_implementation
    return config  # else the family's class picks, as it does loaded on its own


def _can_run(config, attn_implementation: str) -> bool:
    """False where the dense family's class refuses the outer model's attention backend
    (Gemma 2 on transformers 5 has no sdpa: it would drop the attention softcapping)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    return attn_implementation != "sdpa" or getattr(MODEL_MAPPING[type(config)],
                                                    "_supports_sdpa", False)


def embedding_scale(embedding: nn.Module | None) -> float | None:
    """The factor a family's own embedding module multiplies token rows by (Gemma 3; Gemma and
    Gemma 2 on transformers 5: √hidden), or None. Where a family scales inside its model's
    forward instead (Gemma / Gemma 2 on transformers 4) it scales `inputs_embeds` too."""
    scale = getattr(embedding, "scalar_embed_scale", None)
    if scale is None and isinstance(getattr(embedding, "embed_scale", None), torch.Tensor):
        scale = float(embedding.embed_scale)
    return scale


def scale_embeddings(embeds: torch.Tensor, scale: float | None) -> torch.Tensor:
    """embeds [B, T, d] times `scale` cast to their dtype, as the family's embedding does."""
    return embeds if scale is None else embeds * torch.tensor(scale).to(embeds.dtype)


def softcap_logits(logits: torch.Tensor, dense) -> torch.Tensor:
    """cap · tanh(logits / cap) for a dense config with final_logit_softcapping (Gemma 2), in
    the order its ForCausalLM computes it; other logits unchanged."""
    cap = getattr(dense, "final_logit_softcapping", None)
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def causal_lm_output(lm_head: nn.Module, dense, out, labels, logits_to_keep: int,
                     use_cache: bool) -> CausalLMOutputWithPast:
    """From a dense backbone's output: the head's logits of the last `logits_to_keep` positions
    (all when 0; softcapped as the family does), the next-token loss against `labels`, the
    cache."""
    hidden = out.last_hidden_state
    keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
    logits = softcap_logits(lm_head(hidden[:, keep]), dense)
    loss = None
    if labels is not None:
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    return CausalLMOutputWithPast(loss=loss, logits=logits,
                                  **{CACHE: getattr(out, CACHE) if use_cache else None})


def ffn_activation(mlp: nn.Module):
    """The activation a dense family's own MLP module applies to its gate projection (act_fn;
    Phi-3: activation_fn), so a replaced MLP computes the family's FFN (GeLU-tanh in Gemma)."""
    return mlp.act_fn if hasattr(mlp, "act_fn") else mlp.activation_fn


def _describe_key(key) -> str:
    """A loading-report entry: a name, or (name, checkpoint shape, model shape)."""
    if isinstance(key, tuple) and len(key) == 3:
        return f"{key[0]} (checkpoint {list(key[1])}, config {list(key[2])})"
    return str(key)


class MoemergeModel:
    """What moemerge's model classes share (mixed in before PreTrainedModel): strict loading
    (a checkpoint that does not fit its config, e.g. a projector or expert of another width or
    a missing tensor, is an error naming the tensors), attention backends, weight init."""

    _supports_sdpa = True
    supports_gradient_checkpointing = True  # the dense stacks' decoder layers recompute
    _supports_flash_attn = True
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module):
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear | nn.Embedding):
            module.weight.normal_(0.0, std)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward builds its own cache (routing state next to the KV caches)

    @classmethod
    def from_pretrained(cls, *args, output_loading_info: bool = False,
                        ignore_mismatched_sizes: bool = False, **kwargs):
        model, info = super().from_pretrained(*args, output_loading_info=True,
                                              ignore_mismatched_sizes=True, **kwargs)
        if ignore_mismatched_sizes:
            info = {**info, "mismatched_keys": []}
        problems = [f"{kind.replace('_', ' ')}: {', '.join(map(_describe_key, keys[:4]))}"
                    + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
                    for kind, found in sorted(info.items())
                    if kind in ("missing_keys", "mismatched_keys", "unexpected_keys")
                    and (keys := sorted(found))]
        if problems:
            raise ValueError(f"{args[0] if args else 'the checkpoint'} does not fit its "
                             f"config.json: {'; '.join(problems)}")
        return (model, info) if output_loading_info else model
