"""Output config.json, written explicitly as plain JSON with the classic keys.

transformers 5 writes `rope_parameters` and `dtype`; transformers 4 reads `rope_theta`,
`rope_scaling` and `torch_dtype`, and silently falls back to the MoE class's own defaults
(Mixtral: rope_theta 1e6) when they are missing. Both majors read the classic keys, so the
output carries those, copied from the source, and nothing that only one major understands.
"""

from __future__ import annotations

import torch

from moemerge.architectures.tables import MoELayout

# keys copied verbatim from the dense source when present
COPIED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
    "initializer_range", "rms_norm_eps", "use_cache", "pad_token_id", "bos_token_id",
    "eos_token_id", "tie_word_embeddings", "attention_dropout", "attention_bias", "sliding_window",
    "use_sliding_window", "max_window_layers",
)


def rope_keys(source: dict) -> dict:
    """rope_theta / rope_scaling from either a transformers-4 or a transformers-5 config."""
    params = source.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        # transformers 5, one set per layer type (Gemma 3): classic rope_theta is the global
        # layers', rope_local_base_freq the sliding ones'
        keys = rope_keys({"rope_parameters": params["full_attention"]})
        if isinstance(params.get("sliding_attention"), dict):
            keys["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        return keys
    if isinstance(params, dict) and "rope_theta" in params:  # transformers 5
        # (it also writes Phi-3's partial_rotary_factor at the top level, which is kept)
        scaling = {k: v for k, v in params.items()
                   if k not in ("rope_theta", "partial_rotary_factor")}
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        return {"rope_theta": params["rope_theta"], "rope_scaling": scaling}
    theta = source.get("rope_theta", 10000.0)  # transformers 4; 1e4 is the Llama default
    return {"rope_theta": theta, "rope_scaling": source.get("rope_scaling")}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# never carried over: `auto_map` names Python files a loader would import from the output
DROPPED = ("rope_parameters", "dtype", "auto_map", "custom_pipelines")


def dense_config(source: dict, dtype: torch.dtype) -> dict:
    """A dense merge keeps the source's config, normalised to the classic keys, without any
    pointer to remote code."""
    config = {k: v for k, v in source.items() if k not in DROPPED}
    config.update(rope_keys(source), torch_dtype=dtype_name(dtype))
    config.pop("transformers_version", None)
    return config


def moe_config(
    source: dict, layout: MoELayout, dtype: torch.dtype, *, num_experts: int,
    experts_per_token: int, shared_width: int | None = None,
) -> dict:
    """The layout's config.json: the source's keys, the expert counts and widths under the
    layout's own key names, and its fixed settings (all from moe.yaml)."""
    config = {"architectures": [layout.architecture], "model_type": layout.model_type}
    config.update({k: source[k] for k in (*COPIED, *layout.copied_config) if k in source})
    config.update(rope_keys(source), torch_dtype=dtype_name(dtype))
    config.setdefault("tie_word_embeddings", False)
    config.update(num_experts_per_tok=experts_per_token, output_router_logits=False)
    config[layout.num_experts_key] = num_experts
    config[layout.expert_width_key] = source["intermediate_size"]
    if layout.shared_width_key is not None:
        # Qwen2-MoE's mandatory shared expert: a whole FFN, or without one zeros of width 1
        # (plan/shared_expert.py)
        config[layout.shared_width_key] = shared_width or 1
    if layout.shared_count_key is not None:  # DeepSeek-MoE: in experts' widths, or none
        config[layout.shared_count_key] = shared_width and shared_width // source[
            "intermediate_size"]
    config.update(layout.config)
    return config


# the modeling code moemerge ships next to the weights of its own MoE kinds
AUTO_MAP = {
    "AutoConfig": "configuration_moemerge.MoemergeConfig",
    "AutoModelForCausalLM": "modeling_moemerge.MoemergeForCausalLM",
}
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
              "max_position_embeddings")


def sequence_config(assembly: str, experts: list[dict], names: list[str], *, dtype: torch.dtype,
                    width: int, token_source: dict, base: dict | None, **settings) -> dict:
    """config.json of a seq_routed / bridged model (moemerge/modeling/configuration_moemerge.py):
    each expert's (and the base's) dense config kept whole, in the classic keys."""
    config = {"architectures": ["MoemergeForCausalLM"], "model_type": "moemerge",
              "auto_map": dict(AUTO_MAP), "assembly": assembly,
              "experts": [dense_config(e, dtype) for e in experts], "expert_names": names,
              "base": dense_config(base, dtype) if base is not None else None,
              "vocab_size": token_source["vocab_size"], "hidden_size": width}
    config.update({k: token_source[k] for k in TOKEN_KEYS if k in token_source})
    config.update(settings, torch_dtype=dtype_name(dtype), tie_word_embeddings=False,
                  use_cache=True)
    return config


MERGED_AUTO_MAP = {
    "AutoConfig": "configuration_moemerge.MoemergeMergedConfig",
    "AutoModelForCausalLM": "modeling_merged_moemerge.MoemergeMergedForCausalLM",
}


def merged_config(base: dict, names: list[str], *, dtype: torch.dtype, **settings) -> dict:
    """config.json of a merged-experts model (configuration_moemerge.MoemergeMergedConfig): the
    base's dense config kept whole, plus the merging settings."""
    config = {"architectures": ["MoemergeMergedForCausalLM"], "model_type": "moemerge_merged",
              "auto_map": dict(MERGED_AUTO_MAP), "base": dense_config(base, dtype),
              "num_experts": len(names), "expert_names": names}
    config.update({k: base[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                        *TOKEN_KEYS) if k in base})
    config.update(settings, torch_dtype=dtype_name(dtype), tie_word_embeddings=False,
                  use_cache=True)
    return config


LORA_AUTO_MAP = {
    "AutoConfig": "configuration_moemerge.MoemergeLoraConfig",
    "AutoModelForCausalLM": "modeling_lora_moemerge.MoemergeLoraForCausalLM",
}


def lora_config(base: dict, names: list[str], *, dtype: torch.dtype, experts_per_token: int,
                lora_ranks: dict[str, int]) -> dict:
    """config.json of an MoE of LoRA experts (configuration_moemerge.MoemergeLoraConfig): the
    base's dense config kept whole (its tied embeddings too), the experts and the targeted
    modules with their ranks."""
    config = {"architectures": ["MoemergeLoraForCausalLM"], "model_type": "moemerge_lora",
              "auto_map": dict(LORA_AUTO_MAP), "base": dense_config(base, dtype),
              "num_experts": len(names), "expert_names": names,
              "experts_per_token": experts_per_token, "lora_ranks": lora_ranks}
    config.update({k: base[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                        *TOKEN_KEYS) if k in base})
    config.update(torch_dtype=dtype_name(dtype),
                  tie_word_embeddings=bool(base.get("tie_word_embeddings", False)),
                  use_cache=True)
    return config
