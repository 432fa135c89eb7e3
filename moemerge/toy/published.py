"""Checkpoints with the config.json of popular published models, at their real size or shrunk.

The configs (published_configs.json) carry the keys that trip merge tools: tied embeddings (no
`lm_head.weight` on disk), llama3 rope scaling, Qwen's sliding-window keys present but off, an
explicit `head_dim` that is not hidden / heads (Qwen3), Granite's multipliers, bf16 (OLMo 2 is
published in fp32); Gemma 2 / 3 (softcapping, query_pre_attn_scalar, sliding-window layers,
Gemma 3's local rope base) and Phi-3 (fused qkv_proj and gate_up_proj). `published_model`
writes random weights in that dtype and the config.json in the publisher's classic keys, as the
hub has them (not re-serialised by the installed transformers).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch

from moemerge.loading import quiet_transformers
from moemerge.toy.train import init_model

CONFIGS_FILE = Path(__file__).with_name("published_configs.json")
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size",
              # windows shorter than a test's sequences, and a local/global layer pattern that
              # fits in few layers (Gemma 3: every n-th layer global)
              "sliding_window", "sliding_window_pattern")


@cache
def published_configs() -> dict[str, dict]:
    return json.loads(CONFIGS_FILE.read_text())


def shrunk_config(name: str, **shape) -> dict:
    """The published config `name` with the SHAPE_KEYS in `shape` replaced (everything else as
    published); `max_window_layers` follows the layer count, token ids are clamped to the
    vocabulary."""
    config = dict(published_configs()[name])
    unknown = set(shape) - set(SHAPE_KEYS)
    if unknown:
        raise ValueError(f"not shape keys: {sorted(unknown)}")
    config.update(shape)
    if "max_window_layers" in config:
        config["max_window_layers"] = config["num_hidden_layers"]
    vocab = config["vocab_size"]
    for key, inside in (("bos_token_id", 1), ("eos_token_id", 2), ("pad_token_id", 0)):
        if isinstance(config.get(key), int) and config[key] >= vocab:
            config[key] = inside
    return config


def published_model(name: str, out_dir: Path, *, seed: int = 0, tokenizer=None,
                    dtype: torch.dtype | None = None, **shape) -> Path:
    """Write a random checkpoint with the (shrunk) published config `name` to `out_dir`, in
    `dtype` (default: the config's torch_dtype, as published)."""
    from transformers import AutoConfig

    values = shrunk_config(name, **shape)
    dtype = dtype or getattr(torch, values["torch_dtype"])
    kwargs = {k: v for k, v in values.items()
              if k not in ("architectures", "model_type", "torch_dtype", "transformers_version")}
    config = AutoConfig.for_model(values["model_type"], **kwargs)
    out_dir = Path(out_dir)
    with quiet_transformers():
        init_model(config, seed).to(dtype).save_pretrained(out_dir)
    (out_dir / "config.json").write_text(json.dumps(values, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


MODEL_KEYS = ("model", "base_model", "source_model")


def mergekit_example_models(documents: list[dict], local) -> list[dict]:
    """mergekit config documents with every model they name replaced by `local(name)` (a tiny
    local checkpoint standing in for it; the same name, the same checkpoint), the names of
    their own stages (mergekit-multi's `name`, mergekit-mega's `out_path`) kept."""
    stages = {d.get(key) for d in documents for key in ("name", "out_path")} - {None}

    def swapped(value, key=None):
        if isinstance(value, dict):
            return {k: swapped(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [swapped(v, key) for v in value]
        if key in MODEL_KEYS and isinstance(value, str) and value not in stages:
            return str(local(value))
        return value

    return [swapped(d) for d in documents]
