"""Modeling code of the MoE kinds and layouts transformers has no class for (seq_routed,
bridged, merged_experts, lora_experts; the DeepSeek-MoE layout).

The other files here are shipped next to the weights and loaded by transformers with
trust_remote_code; they import nothing from moemerge. moemerge's own commands call `register()`
instead, so they load these kinds with the installed code and never run code from a model dir.
"""

from __future__ import annotations

from functools import cache

MODEL_TYPE = "moemerge"
MERGED_MODEL_TYPE = "moemerge_merged"
LORA_MODEL_TYPE = "moemerge_lora"
DEEPSEEK_MODEL_TYPE = "deepseek"


@cache
def register() -> None:
    """Make AutoConfig / AutoModelForCausalLM know these model types (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moemerge.modeling.configuration_deepseek import DeepseekConfig
    from moemerge.modeling.configuration_moemerge import (
        MoemergeConfig,
        MoemergeLoraConfig,
        MoemergeMergedConfig,
    )
    from moemerge.modeling.modeling_deepseek import DeepseekForCausalLM
    from moemerge.modeling.modeling_lora_moemerge import MoemergeLoraForCausalLM
    from moemerge.modeling.modeling_merged_moemerge import MoemergeMergedForCausalLM
    from moemerge.modeling.modeling_moemerge import MoemergeForCausalLM

    for model_type, config, model in ((MODEL_TYPE, MoemergeConfig, MoemergeForCausalLM),
                                      (MERGED_MODEL_TYPE, MoemergeMergedConfig,
                                       MoemergeMergedForCausalLM),
                                      (LORA_MODEL_TYPE, MoemergeLoraConfig,
                                       MoemergeLoraForCausalLM),
                                      (DEEPSEEK_MODEL_TYPE, DeepseekConfig, DeepseekForCausalLM)):
        AutoConfig.register(model_type, config, exist_ok=True)
        AutoModelForCausalLM.register(config, model, exist_ok=True)
