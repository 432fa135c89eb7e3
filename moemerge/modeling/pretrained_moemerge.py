"""What moemerge's shipped model classes share (shipped next to the weights): a dense expert's
config from its config.json dict, and strict loading.

Every shipped module imports its moemerge neighbours directly: transformers 4 copies only the
files a remote-code module imports itself, not what those import in turn.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig


def dense_config(values: dict, attn_implementation: str | None):
    """A dense expert's transformers config from its config.json dict (classic keys accepted)."""
    # no dtype: the submodel takes the one the outer model is loaded or built in
    values = {k: v for k, v in values.items()
              if k not in ("architectures", "auto_map", "torch_dtype", "dtype")}
    config = AutoConfig.for_model(**values)
    config.tie_word_embeddings = False  # heads are separate tensors here
    if attn_implementation:
        config._attn_implementation = attn_implementation
    return config


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
