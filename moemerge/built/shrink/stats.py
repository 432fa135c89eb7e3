"""Per-layer expert statistics of a token-routed MoE from calibration text, in one forward pass.

A forward pre-hook on every router reads the block's input x [T, H] (the tokens of the batch),
routes it as the model does (softmax over the experts, top-k, renormalised where the layout
renormalises) and, per expert, runs the expert's FFN on the tokens routed to it, with its
weights read from the checkpoint through `moemerge extract`'s layout helpers (one layer's
experts at a time, whatever the in-memory layout of the installed transformers). It records:

- frequency[e]: the expert's share of the layer's top-k slots (sums to 1 over e);
- reap[e]: REAP saliency (Lasby et al. 2025, "REAP: Router-weighted Expert Activation
  Pruning"), the mean over the tokens routed to e of gate weight g_e(x) × ‖FFN_e(x)‖₂; 0 for an
  expert no token chose;
- gram [E, E]: Σ_t ⟨FFN_e(x_t), FFN_f(x_t)⟩ over the first `sample` tokens, every expert on
  every one of them: the cosine similarity of the experts' outputs that `merge` clusters on;
- probs [T, E]: the full routing distribution of every token, the targets of router repair.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from moemerge.architectures.tables import MoELayout
from moemerge.io.moe_expert import PROJECTIONS, expert_ffn
from moemerge.io.reader import CheckpointReader
from moemerge.routing.calibrate import BATCH
from moemerge.routing.modules import find_routers


@dataclass
class LayerStats:
    num_experts: int
    slots: torch.Tensor = None  # [E] top-k slots taken
    reap_sum: torch.Tensor = None  # [E] Σ g·‖out‖ over routed tokens
    gram: torch.Tensor = None  # [E, E] float64 Gram matrix of the outputs on the sample
    sampled: int = 0  # tokens in the Gram matrix
    probs: list[torch.Tensor] = field(default_factory=list)  # [T_b, E] per batch

    def __post_init__(self):
        e = self.num_experts
        self.slots = torch.zeros(e, dtype=torch.float64)
        self.reap_sum = torch.zeros(e, dtype=torch.float64)
        self.gram = torch.zeros(e, e, dtype=torch.float64)

    @property
    def frequency(self) -> torch.Tensor:
        return self.slots / self.slots.sum().clamp_min(1)

    @property
    def reap(self) -> torch.Tensor:
        return self.reap_sum / self.slots.clamp_min(1)

    @property
    def similarity(self) -> torch.Tensor:
        """[E, E] cosine similarity of the experts' outputs on the sampled tokens."""
        norm = self.gram.diagonal().clamp_min(1e-30).sqrt()
        return self.gram / norm[:, None] / norm[None, :]

    @property
    def routing(self) -> torch.Tensor:
        """[T, E] the original model's routing distribution of every calibration token."""
        return torch.cat(self.probs)


def renormalises(layout: MoELayout, config: dict) -> bool:
    """Whether the top-k weights are renormalised to sum 1 (always: moe.yaml's
    `renormalises_topk`; else as config.json's norm_topk_prob says)."""
    return layout.renormalises_topk or bool(config.get("norm_topk_prob", False))


def _ffn(x: torch.Tensor, weights: dict[str, torch.Tensor], act) -> torch.Tensor:
    """x [n, H] -> down(act(gate x) * up x) [n, H]; gate / up [I, H], down [H, I]."""
    return F.linear(act(F.linear(x, weights["gate"])) * F.linear(x, weights["up"]),
                    weights["down"])


class _LayerHook:
    """Statistics of one layer's sparse block, accumulated batch by batch."""

    def __init__(self, reader: CheckpointReader, layout: MoELayout, layer: int, router,
                 top_k: int, renorm: bool, act, sample: int):
        self.reader, self.layout, self.layer, self.router = reader, layout, layer, router
        self.top_k, self.renorm, self.act, self.sample = top_k, renorm, act, sample
        self.stats = LayerStats(router.weight.shape[0])

    def expert(self, e: int) -> dict[str, torch.Tensor]:
        return {p: expert_ffn(self.reader, self.layout, self.layer, e, p)[2]().float()
                for p in PROJECTIONS}

    @torch.no_grad()
    def __call__(self, _module, args) -> None:
        x = args[0].detach().float().reshape(-1, args[0].shape[-1])  # [T, H]
        logits = F.linear(x, self.router.weight.float(),
                          None if getattr(self.router, "bias", None) is None
                          else self.router.bias.float())  # [T, E]
        probs = torch.softmax(logits, dim=-1)
        top_w, top_i = probs.topk(self.top_k, dim=-1)  # [T, k]; ties: the lower index first
        if self.renorm:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        stats = self.stats
        stats.probs.append(probs)
        take = max(0, min(self.sample - stats.sampled, x.shape[0]))
        outs = []
        for e in range(stats.num_experts):
            weights = self.expert(e)
            rows, slot = torch.nonzero(top_i == e, as_tuple=True)
            stats.slots[e] += len(rows)
            if len(rows):
                norms = _ffn(x[rows], weights, self.act).norm(dim=-1)
                stats.reap_sum[e] += float((top_w[rows, slot] * norms).double().sum())
            if take:
                outs.append(_ffn(x[:take], weights, self.act).double().flatten())
        if take:
            stacked = torch.stack(outs)  # [E, take·H]
            stats.gram += stacked @ stacked.T
            stats.sampled += take


@torch.no_grad()
def collect_stats(model, reader: CheckpointReader, layout: MoELayout, config: dict,
                  ids: torch.Tensor, sample: int) -> dict[int, LayerStats]:
    """{layer: statistics} of every sparse layer of `model` (loaded from `reader`'s
    checkpoint) on the windows ids [W, S+1] (inputs ids[:, :-1]), BATCH windows per forward;
    every token's routing is kept in the order `routing.calibrate` captures router inputs."""
    from transformers.activations import ACT2FN

    num_experts = layout.expert_count(config)
    top_k = int(config.get("num_experts_per_tok", 2))
    act = ACT2FN[config.get("hidden_act", "silu")]
    renorm = renormalises(layout, config)
    hooks = {layer: _LayerHook(reader, layout, layer, router, top_k, renorm, act, sample)
             for layer, router in find_routers(model, num_experts)}
    handles = [hook.router.register_forward_pre_hook(hook) for hook in hooks.values()]
    try:
        for start in range(0, ids.shape[0], BATCH):
            model(input_ids=ids[start:start + BATCH, :-1])
    finally:
        for handle in handles:
            handle.remove()
    return {layer: hook.stats for layer, hook in hooks.items()}
