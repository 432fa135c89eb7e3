"""Sequence-level routing for moemerge's MoE kinds (shipped next to the weights).

A routing decision is a weight matrix W [B, N]: row b holds the weights of the k experts that
sequence b goes to, zeros elsewhere. It is made once, on the whole input (for generation: the
prompt), and kept in `RoutedCache` with each chosen expert's own KV cache, so every generated
token goes through the same experts with the same weights.

Scores [B, N] that become W = softmax(top-k(scores) / temperature):
- learned:     router logits of the mean token embedding, RMS-normalised when the config's
               router_input is "rms_mean_embedding" (softmax over the top k logits is the
               renormalised top k of the full softmax, as in Mixtral);
- perplexity:  log(1 / PPL) = −mean NLL of each expert on the sequence, so that W is each
               chosen expert's 1 / PPL^(1/temperature), normalised ("log_inverse"); checkpoints
               whose config predates `perplexity_score` score 1 / PPL itself ("inverse"), whose
               small, close values leave a softmax near uniform;
- task_vector: cos(−∇ base loss on the sequence, τ_e): the expert whose fine-tuning moved the
               base most in the direction that would lower its loss on this sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache


def topk_weights(scores: torch.Tensor, k: int, temperature: float) -> torch.Tensor:
    """scores [B, N] -> W [B, N]: softmax over each row's top k scores, zero elsewhere."""
    top = scores.float().topk(k, dim=-1)
    weights = torch.softmax(top.values / temperature, dim=-1)
    return torch.zeros_like(scores, dtype=weights.dtype).scatter(-1, top.indices, weights)


def mean_embedding(embeds: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """embeds [B, T, H], mask [B, T] (1 = token) -> mean over each sequence's tokens [B, H]."""
    if attention_mask is None:
        return embeds.mean(dim=1)
    mask = attention_mask[..., None].to(embeds.dtype)
    return (embeds * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)


def rms_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [B, H] divided by its root mean square over H: [B, H] of RMS 1. A mean embedding's norm
    is small (≈ 0.14 on the toy models) and varies by model, which made a learned router's
    logits, and its gradients, tiny at the default learning rate."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def sequence_nll(logits: torch.Tensor, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean next-token NLL of each sequence: logits [B, T, V], ids [B, T] -> [B] (0 when a
    sequence has no scored token, i.e. a one-token prompt)."""
    nll = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), input_ids[:, 1:],
                          reduction="none")  # [B, T-1]
    scored = torch.ones_like(nll)
    if attention_mask is not None:
        scored = (attention_mask[:, 1:] * attention_mask[:, :-1]).to(nll.dtype)
    return (nll * scored).sum(dim=1) / scored.sum(dim=1).clamp_min(1.0)


def perplexity_scores(nll: torch.Tensor, score: str = "log_inverse") -> torch.Tensor:
    """[N, B] mean NLLs -> [B, N] scores: log(1/PPL) = −NLL, or 1/PPL = exp(−NLL) ("inverse")."""
    return (torch.exp(-nll) if score == "inverse" else -nll).T


def _dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """The dot product of two parameter lists seen as flat vectors, in float64 (g·W_e − g·W_base
    subtracts two large numbers)."""
    return sum((x.double() * y.double()).sum() for x, y in zip(a, b, strict=True))


class TaskVectorScorer:
    """Scores [B, N] = cos(−g_b, τ_e), g_b the gradient of the base model's loss on sequence b
    over the selected parameters, τ_e = expert e's parameters − the base's. τ is never stored:
    g·τ_e = g·W_e − g·W_base."""

    def __init__(self, base: torch.nn.Module, experts: list[torch.nn.Module], select: list[str]):
        self.base = base
        self.names = [n for n, _ in base.model.named_parameters() if any(s in n for s in select)]
        if not self.names:
            raise ValueError(f"task_vector_params {select} match no parameter of the base model")
        self.experts = experts
        self._norms: tuple | None = None  # (parameter versions, ‖τ_e‖ [N])

    def _params(self, module: torch.nn.Module) -> list[torch.Tensor]:
        params = dict(module.named_parameters())
        return [params[n] for n in self.names]

    @torch.no_grad()
    def norms(self) -> torch.Tensor:
        """‖τ_e‖ for every expert: [N], computed once and again only after a parameter changed
        (an optimizer step or a load bumps the tensors' versions)."""
        params = self._params(self.base.model) + [p for e in self.experts
                                                  for p in self._params(e.model)]
        key = tuple((p._version, p.data_ptr()) for p in params)
        if self._norms is None or self._norms[0] != key:
            base = self._params(self.base.model)
            taus = [[w - b for w, b in zip(self._params(e.model), base, strict=True)]
                    for e in self.experts]
            self._norms = (key, torch.stack([_dot(t, t).sqrt() for t in taus]))
        return self._norms[1]

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        base = self._params(self.base.model)
        frozen = [p for p in base if not p.requires_grad]
        for p in frozen:  # the gradient is taken even when the base is frozen (finetune)
            p.requires_grad_(True)
        try:
            return torch.stack([self._score(input_ids[b: b + 1], base,
                                            attention_mask[b: b + 1]
                                            if attention_mask is not None else None)
                                for b in range(input_ids.shape[0])])  # one gradient per row
        finally:
            for p in frozen:
                p.requires_grad_(False)

    def _score(self, ids: torch.Tensor, base: list[torch.Tensor],
               mask: torch.Tensor | None) -> torch.Tensor:
        """cos(−g, τ_e) for one sequence ids [1, T]: [N]."""
        with torch.enable_grad():
            logits = self.base(input_ids=ids, attention_mask=mask).logits
            loss = sequence_nll(logits, ids, mask).sum()
            grads = torch.autograd.grad(loss, base, allow_unused=True)
        with torch.no_grad():
            grads = [g if g is not None else torch.zeros_like(p)
                     for g, p in zip(grads, base, strict=True)]
            base_dot = _dot(grads, base)
            dots = torch.stack([_dot(grads, self._params(e.model)) - base_dot
                                for e in self.experts])  # g·τ_e, [N]
            denom = (_dot(grads, grads).sqrt() * self.norms()).clamp_min(1e-12)
            return (-dots / denom).float()  # descent direction −g


class RoutedCache(Cache):
    """The routing decision W [B, N] plus one KV cache per chosen expert, for generation."""

    is_compileable = False

    def __init__(self, weights: torch.Tensor, caches: dict[int, Cache]):
        self.layers = []  # the base class's per-layer list; each expert cache holds its own
        self.weights = weights
        self.caches = caches

    def __len__(self) -> int:
        return max((len(c) for c in self.caches.values()), default=0)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return next(iter(self.caches.values())).get_seq_length(layer_idx) if self.caches else 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # dynamic caches grow without a bound

    def reset(self) -> None:
        for cache in self.caches.values():
            cache.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.weights = self.weights.index_select(0, beam_idx.to(self.weights.device))
        for cache in self.caches.values():
            cache.reorder_cache(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        for cache in self.caches.values():
            cache.crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.weights = self.weights.repeat_interleave(repeats, dim=0)
        for cache in self.caches.values():
            cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.weights = self.weights[indices]
        for cache in self.caches.values():
            cache.batch_select_indices(indices)
