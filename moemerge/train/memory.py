"""Training memory: gradient checkpointing for every kind finetune trains."""

from __future__ import annotations

import torch

from moemerge.errors import RecipeError


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass instead of keeping them
    (transformers' checkpointing of its decoder layers: a Mixtral's / Qwen MoE's own, every
    expert stack's in seq_routed and bridged, the backbone's in merged experts). Non-reentrant,
    so frozen inputs and parameters that get no gradient are fine."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise RecipeError(f"--gradient-checkpointing: {type(model).__name__} does not support "
                          "gradient checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers ≥ 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False  # a KV cache is for generation; it would be rebuilt anyway
