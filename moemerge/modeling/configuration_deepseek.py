"""Configuration of DeepSeek-MoE (v1: `DeepseekForCausalLM`, model_type "deepseek"), with the
keys of deepseek-ai/deepseek-moe-16b's config.json, which llama.cpp's converter also reads.

Llama's decoder (attention, norms, RoPE and every Llama key come from LlamaConfig) whose FFNs
are MoE blocks: `n_routed_experts` experts of width `moe_intermediate_size`, `num_experts_per_tok`
of them per token, plus `n_shared_experts` always-on experts fused into one FFN of width
n_shared_experts × moe_intermediate_size (none when null). Layers below `first_k_dense_replace`,
and those not a multiple of `moe_layer_freq`, keep a dense FFN of width `intermediate_size`.

This file is copied verbatim into every output directory: it imports only transformers.
"""

from __future__ import annotations

from transformers import LlamaConfig


class DeepseekConfig(LlamaConfig):
    r"""
    Args (beyond LlamaConfig's):
        n_routed_experts: routed experts per MoE layer.
        n_shared_experts: always-on experts per MoE layer (their FFNs side by side), or None.
        num_experts_per_tok: k, the routed experts each token goes to.
        moe_intermediate_size: each routed (and shared) expert's FFN width.
        first_k_dense_replace: the first layers keep a dense FFN.
        moe_layer_freq: an MoE block in every layer whose index is a multiple of this.
        scoring_func: "softmax" (the only one DeepSeek-MoE v1 defines).
        norm_topk_prob: renormalise the top-k weights to sum to 1.
        aux_loss_alpha: the load-balancing loss's coefficient when training with
            output_router_logits.
        seq_aux: DeepSeek's per-sequence balance loss (kept for its config's sake; the loss
            returned here is the Switch loss over tokens, as Mixtral's).
    """

    model_type = "deepseek"

    def __init__(self, n_routed_experts: int | None = None, n_shared_experts: int | None = None,
                 num_experts_per_tok: int | None = None, moe_intermediate_size: int = 1407,
                 first_k_dense_replace: int = 0, moe_layer_freq: int = 1,
                 scoring_func: str = "softmax", norm_topk_prob: bool = False,
                 aux_loss_alpha: float = 0.001, seq_aux: bool = True, **kwargs):
        if scoring_func != "softmax":
            raise ValueError(f"scoring_func {scoring_func!r}: DeepSeek-MoE v1 scores experts by "
                             "softmax only")
        self.n_routed_experts = n_routed_experts
        self.n_shared_experts = n_shared_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.first_k_dense_replace = first_k_dense_replace
        self.moe_layer_freq = moe_layer_freq
        self.scoring_func = scoring_func
        self.norm_topk_prob = norm_topk_prob
        self.aux_loss_alpha = aux_loss_alpha
        self.seq_aux = seq_aux
        super().__init__(**kwargs)

    def is_moe_layer(self, layer: int) -> bool:
        return (self.n_routed_experts is not None and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)
