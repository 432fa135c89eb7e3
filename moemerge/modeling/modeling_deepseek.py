"""DeepSeek-MoE (v1: `DeepseekForCausalLM`) as a transformers model (shipped next to the weights).

Llama's decoder with its FFNs replaced by MoE blocks (configuration_deepseek.py says which):

    p = softmax(x Gᵀ)                 G = mlp.gate.weight [N, H], x the post-attention-normed
                                      hidden state [T, H]
    w, i = top-k of p                 renormalised to sum to 1 when norm_topk_prob (and k > 1)
    y = Σ_j w_j FFN_{i_j}(x) + FFN_shared(x)

FFN(x) = down(act(gate(x)) ⊙ up(x)); the shared FFN (width n_shared_experts ×
moe_intermediate_size) is ungated and absent when n_shared_experts is null. Tensor names are
deepseek-ai/deepseek-moe-16b's: mlp.gate.weight, mlp.experts.{e}.{gate,up,down}_proj.weight,
mlp.shared_experts.{gate,up,down}_proj.weight. With `output_router_logits` the output carries
each MoE layer's router logits and the Switch load-balancing loss over them (`aux_loss`).

This file is copied verbatim into every output directory: it imports only transformers.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaForCausalLM
from transformers.activations import ACT2FN
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from .configuration_deepseek import DeepseekConfig


class DeepseekMLP(nn.Module):
    def __init__(self, config: DeepseekConfig, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DeepseekMoE(nn.Module):
    """One layer's routed experts, their router and the shared experts."""

    def __init__(self, config: DeepseekConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        width = config.moe_intermediate_size
        self.gate = nn.Linear(config.hidden_size, config.n_routed_experts, bias=False)
        self.experts = nn.ModuleList(DeepseekMLP(config, width)
                                     for _ in range(config.n_routed_experts))
        shared = config.n_shared_experts
        self.shared_experts = DeepseekMLP(config, width * shared) if shared else None
        self.router_logits: torch.Tensor | None = None  # [T, N] of the last forward

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, hidden.shape[-1])  # [T, H]
        logits = self.gate(x)  # [T, N]
        self.router_logits = logits
        weights, chosen = torch.topk(logits.float().softmax(dim=-1), self.top_k, dim=-1)
        if self.top_k > 1 and self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero(chosen == e, as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.reshape(hidden.shape)


class DeepseekForCausalLM(LlamaForCausalLM):
    config_class = DeepseekConfig

    def __init__(self, config: DeepseekConfig):
        super().__init__(config)
        for index, layer in enumerate(self.model.layers):
            if config.is_moe_layer(index):
                layer.mlp = DeepseekMoE(config)
                layer.mlp.apply(self._init_weights)
        self.post_init()

    def forward(self, *args, output_router_logits: bool | None = None, **kwargs):
        if output_router_logits is None:
            output_router_logits = getattr(self.config, "output_router_logits", False)
        out = super().forward(*args, **kwargs)
        if not output_router_logits:
            return out
        moes = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, DeepseekMoE)]
        router_logits = tuple(moe.router_logits for moe in moes)
        aux_loss = load_balancing_loss_func(router_logits, self.config.n_routed_experts,
                                            self.config.num_experts_per_tok)
        fields = dict(out.items())
        if fields.get("loss") is not None:
            fields["loss"] = fields["loss"] + self.config.aux_loss_alpha * aux_loss
        return MoeCausalLMOutputWithPast(**fields, aux_loss=aux_loss,
                                         router_logits=router_logits)
