"""Modeling code of the MoE kinds transformers has no class for (seq_routed, bridged,
merged_experts).

The other files here are shipped next to the weights and loaded by transformers with
trust_remote_code; they import nothing from moemerge. moemerge's own commands call `register()`
instead, so they load these kinds with the installed code and never run code from a model dir.
"""

from __future__ import annotations

from functools import cache

MODEL_TYPE = "moemerge"
MERGED_MODEL_TYPE = "moemerge_merged"


@cache
def register() -> None:
    """Make AutoConfig / AutoModelForCausalLM know model_type 'moemerge' (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moemerge.modeling.configuration_moemerge import MoemergeConfig, MoemergeMergedConfig
    from moemerge.modeling.modeling_merged_moemerge import MoemergeMergedForCausalLM
    from moemerge.modeling.modeling_moemerge import MoemergeForCausalLM

    for model_type, config, model in ((MODEL_TYPE, MoemergeConfig, MoemergeForCausalLM),
                                      (MERGED_MODEL_TYPE, MoemergeMergedConfig,
                                       MoemergeMergedForCausalLM)):
        AutoConfig.register(model_type, config, exist_ok=True)
        AutoModelForCausalLM.register(config, model, exist_ok=True)


def is_sequence_routed(config) -> bool:
    """True for a config of moemerge's seq_routed / bridged kinds (a dict or a config object)."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    return get("model_type") == MODEL_TYPE
