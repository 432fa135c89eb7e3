"""An MoE whose experts are LoRA adapters of one base (X-LoRA / MoLE / mergoo), as a
transformers model (shipped with the weights).

The backbone is the base's dense model (its own transformers class), stored once. Every linear
module some adapter targets becomes a `LoraExpertsLinear`: the base weight W [O, I] plus the
experts' factors A [E, R, I] and B [E, O, R] (each expert's scale s_e = α/r or α/√r folded into
its B; a rank below R zero-padded), and computes

    y = x Wᵀ + Σ_e g_e(x) · (x A_eᵀ) B_eᵀ

with g the routing weights of the token. Each block holding targeted modules (the MLP, the
attention) has its own router [E, H] on the block's input (the hidden state the block
reads), run once per forward of the block by a forward pre-hook: softmax over the experts,
then the top k kept and renormalised (k = experts_per_token; k = E: a dense mixture of every
adapter). Routing every token to expert e (`route_to(e)`) computes base + adapter e exactly as
peft does.

Tensor names: the base's (model.*, lm_head.weight unless the embeddings are tied), plus per
targeted module M: M.lora_A [E, R, I], M.lora_B [E, O, R]; per routed block: <block>.router.weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import AutoModel, GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache

from .configuration_moemerge import MoemergeLoraConfig
from .pretrained_moemerge import CACHE, MoemergeModel, causal_lm_output, dense_config, given_cache


class LoraRouter(nn.Linear):
    """A block's router [E, H]; `gates` holds the routing weights [..., E] of the block's last
    input (set by `route`, read by the block's LoraExpertsLinear modules)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__(hidden, num_experts, bias=False)
        self.top_k = top_k
        self.forced: int | None = None  # route_to(e): every token to expert e
        self.gates: torch.Tensor | None = None

    def route(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> routing weights [..., E] in h's dtype."""
        if self.forced is not None:
            gates = F.one_hot(torch.full(h.shape[:-1], self.forced, device=h.device),
                              self.out_features)
            return gates.to(h.dtype)
        probs = torch.softmax(self(h).float(), dim=-1)
        if self.top_k < self.out_features:
            top, index = probs.topk(self.top_k, dim=-1)
            probs = torch.zeros_like(probs).scatter(-1, index, top / top.sum(-1, keepdim=True))
        return probs.to(h.dtype)

    def hook(self, _block, args, kwargs):
        """The block's forward pre-hook: route its input hidden state (positional or
        `hidden_states=`)."""
        self.gates = self.route(args[0] if args else kwargs["hidden_states"])


class LoraExpertsLinear(nn.Linear):
    """A base linear layer plus the experts' LoRA deltas, mixed by its block's routing."""

    def __init__(self, base: nn.Linear, num_experts: int, rank: int, router: LoraRouter):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.lora_A = nn.Parameter(torch.zeros(num_experts, rank, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(num_experts, base.out_features, rank))
        self._router = (router,)  # not a child: the block owns it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = self._router[0].gates  # [..., E]
        if gates is None:
            raise RuntimeError("a LoRA-experts layer ran before its block's router")
        low = torch.einsum("...i,eri->...er", x, self.lora_A.to(x.dtype))  # [..., E, R]
        low = low * gates.to(x.dtype)[..., None]
        return F.linear(x, self.weight, self.bias) + torch.einsum(
            "...er,eor->...o", low, self.lora_B.to(x.dtype))


class MoemergeLoraForCausalLM(MoemergeModel, PreTrainedModel, GenerationMixin):
    config_class = MoemergeLoraConfig
    base_model_prefix = "moemerge_lora"
    # with tie_word_embeddings, as the base ties (transformers 5 maps the head to its source)
    _tied_weights_keys = ({"lm_head.weight": "model.embed_tokens.weight"}
                          if int(transformers.__version__.split(".")[0]) >= 5
                          else ["lm_head.weight"])

    def __init__(self, config: MoemergeLoraConfig):
        super().__init__(config)
        config.check()
        self.dense_config = dense_config(config.base, getattr(config, "_attn_implementation",
                                                              None))
        self.dense_config.tie_word_embeddings = config.tie_word_embeddings
        self.model = AutoModel.from_config(self.dense_config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        top_k = config.experts_per_token
        for name, rank in config.lora_ranks.items():
            block_name, _, leaf = name.removeprefix("model.").rpartition(".")
            block = self.model.get_submodule(block_name)
            router = getattr(block, "router", None)
            if router is None:
                router = LoraRouter(config.hidden_size, config.num_experts, top_k)
                block.router = router
                block.register_forward_pre_hook(router.hook, with_kwargs=True)
            setattr(block, leaf, LoraExpertsLinear(getattr(block, leaf), config.num_experts,
                                                   rank, router))
        self._no_split_modules = [type(self.model.layers[0]).__name__]  # device_map="auto"
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def router_modules(self) -> dict[str, LoraRouter]:
        """{name: router} in layer order (what finetune trains with --router-only)."""
        return {name: m for name, m in self.named_modules() if isinstance(m, LoraRouter)}

    def route_to(self, expert: int | None) -> None:
        """Send every token to `expert` (the model is then the base with that adapter), or
        back to the routers with None."""
        if expert is not None and not 0 <= expert < self.config.num_experts:
            raise ValueError(f"expert {expert} is not one of the {self.config.num_experts}")
        for router in self.router_modules().values():
            router.forced = expert

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0,
                past_key_values=None, **kwargs):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        cache = given_cache(cache, past_key_values)
        if use_cache and cache is None:
            try:
                cache = DynamicCache(config=self.dense_config)  # transformers 5
            except TypeError:
                cache = DynamicCache()  # transformers 4
        out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds,
                         attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=use_cache, **{CACHE: cache}, **kwargs)
        return causal_lm_output(self.lm_head, self.dense_config, out, labels, logits_to_keep,
                                use_cache)
