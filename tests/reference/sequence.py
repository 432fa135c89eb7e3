"""Reference forwards of seq_routed and bridged (MergeME; docs/sequence-routing.md), one
sequence at a time.

For a sequence x of T tokens and experts e = 1..N, each expert's dense model gives logits z_e
[T, V] and final hidden states h_e [T, d]. Scores s [N]:
  learned      s = R · m / rms(m), m = mean_t emb(x_t), rms(m) = sqrt(mean_i m_i² + 1e-6)
               (s = R · m for checkpoints whose config predates `router_input`)
  perplexity   s_e = −mean_t NLL_e(x_{t+1} | x_≤t) = log(1/PPL_e)
               (s_e = exp(−mean NLL) = 1/PPL_e for checkpoints whose config predates
               `perplexity_score`)
  task_vector  s_e = cos(−∇_θ L_base(x), τ_e), τ_e = θ_e − θ_base over the selected parameters
Weights w = softmax(top-k(s) / temperature) on the k best experts. Output: z_e when k = 1;
log Σ_e w_e softmax(z_e) (mix logits); Σ_e w_e h_e through the shared head (mix hidden).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reference.dense import embedding, final_hidden, head


def mean_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:-1], ids[1:])


def task_vector_scores(base, experts, ids: torch.Tensor, select=("layers.",)) -> torch.Tensor:
    """cos(−g, τ_e) [N] in float64, τ_e formed explicitly."""
    params = {n: p for n, p in base.model.named_parameters() if any(s in n for s in select)}
    names = sorted(params)
    loss = mean_nll(base(input_ids=ids[None]).logits[0], ids)
    grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
    g = torch.cat([(gr if gr is not None else torch.zeros_like(params[n])).double().flatten()
                   for gr, n in zip(grads, names, strict=True)])
    scores = []
    for expert in experts:
        own = dict(expert.model.named_parameters())
        tau = torch.cat([(own[n].double() - params[n].double()).flatten() for n in names])
        scores.append(-(g @ tau) / (g.norm() * tau.norm()))
    return torch.stack(scores).float()


def routing_weights(scores: torch.Tensor, k: int, temperature: float) -> dict[int, float]:
    """{expert: weight} of the k best scores."""
    top = scores.topk(k)
    weights = torch.softmax(top.values / temperature, dim=0)
    return {int(e): w for e, w in zip(top.indices, weights, strict=True)}


def mix(weights: dict, logits: dict, hidden: dict, how: str, shared_head) -> torch.Tensor:
    if len(weights) == 1:
        (e,) = weights
        return logits[e]
    if how == "hidden":
        return sum(w * hidden[e] for e, w in weights.items()) @ shared_head.T
    return torch.logsumexp(torch.stack([torch.log(w) + F.log_softmax(logits[e], -1)
                                        for e, w in weights.items()]), dim=0)


def scores_of(router, ids, mean_embed, logits, *, router_weight=None, base=None, experts=None,
              router_input="rms_mean_embedding", perplexity_score="log_inverse"):
    if router == "learned":
        if router_input == "rms_mean_embedding":
            mean_embed = mean_embed / torch.sqrt((mean_embed ** 2).mean() + 1e-6)
        return router_weight @ mean_embed
    if router == "perplexity":
        nll = torch.stack([mean_nll(z, ids) for z in logits])
        return torch.exp(-nll) if perplexity_score == "inverse" else -nll
    return task_vector_scores(base, experts, ids)


def seq_routed(ids: torch.Tensor, experts: list, *, router: str, k: int, temperature: float,
               how: str, shared: bool, router_weight=None, base=None,
               router_input="rms_mean_embedding", perplexity_score="log_inverse",
               prompt: int | None = None) -> torch.Tensor:
    """ids [B, T] -> logits [B, T, V]. `shared`: one embedding and head, the plain average of
    the experts' (a tied expert's head is its embedding); else each expert keeps its own.
    `prompt`: route on the first `prompt` tokens only, as generation after a prompt does."""
    embeds = [embedding(m) for m in experts]
    heads = [head(m) for m in experts]
    if shared:
        embeds = [torch.stack(embeds).mean(0)] * len(experts)
        heads = [torch.stack(heads).mean(0)] * len(experts)
    rows = []
    for x in ids:
        hidden = [final_hidden(m, E[x]) for m, E in zip(experts, embeds, strict=True)]
        logits = [h @ H.T for h, H in zip(hidden, heads, strict=True)]
        p = x[:prompt]  # the tokens routed on
        mean_embed = torch.stack([E[p] for E in embeds]).mean(0).mean(0)  # over experts, tokens
        with torch.enable_grad():
            s = scores_of(router, p, mean_embed, [z[:len(p)] for z in logits],
                          router_weight=router_weight, base=base, experts=experts,
                          router_input=router_input, perplexity_score=perplexity_score)
        rows.append(mix(routing_weights(s, k, temperature), dict(enumerate(logits)),
                        dict(enumerate(hidden)), how, heads[0]))
    return torch.stack(rows)


def pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(t, (0, width - t.shape[1]))


def projector(x: torch.Tensor, tensors: dict, prefix: str) -> torch.Tensor:
    """y = L x + D silu(U x) (the MLP branch only where the output has one)."""
    y = x @ tensors[f"{prefix}.linear.weight"].T
    if f"{prefix}.up.weight" in tensors:
        y = y + F.silu(x @ tensors[f"{prefix}.up.weight"].T) @ tensors[f"{prefix}.down.weight"].T
    return y


def bridged(ids: torch.Tensor, experts: list, tensors: dict, *, router: str, k: int,
            temperature: float, how: str, router_input="rms_mean_embedding",
            prompt: int | None = None) -> torch.Tensor:
    """ids [B, T] -> logits [B, T, V]. Shared embedding and head: the experts' zero-padded to
    the widest width d_m and averaged; expert e runs proj_out(stack_e(proj_in(embed))).
    `prompt`: route on the first `prompt` tokens only, as generation after a prompt does."""
    width = max(embedding(m).shape[1] for m in experts)
    shared_embed = torch.stack([pad_to(embedding(m), width) for m in experts]).mean(0)
    shared_head = torch.stack([pad_to(head(m), width) for m in experts]).mean(0)
    rows = []
    for x in ids:
        embeds = shared_embed[x]  # [T, d_m]
        hidden = []
        for e, model in enumerate(experts):
            inner = final_hidden(model, projector(embeds, tensors, f"experts.{e}.proj_in"))
            hidden.append(projector(inner, tensors, f"experts.{e}.proj_out"))
        logits = [h @ shared_head.T for h in hidden]
        p = x[:prompt]  # the tokens routed on
        s = scores_of(router, p, embeds[:len(p)].mean(0), [z[:len(p)] for z in logits],
                      router_weight=tensors["router.weight"], router_input=router_input)
        rows.append(mix(routing_weights(s, k, temperature), dict(enumerate(logits)),
                        dict(enumerate(hidden)), how, shared_head))
    return torch.stack(rows)
