"""Decoding written plainly: a search over full forwards, no cache, to compare generate() with."""

from __future__ import annotations

import torch

NEW_TOKENS = 9


def search(next_logits, prompt: torch.Tensor, beams: int, new_tokens: int = NEW_TOKENS):
    """Beam search written plainly (beams = 1: greedy): each step, the next-token logits of
    every running prefix from `next_logits` ([B, T] -> [B, V]), and the `beams` best prefix +
    token by summed log-probability. -> (sequences [beams, T + new_tokens], scores [beams])."""
    running, scores = prompt, torch.zeros(1)
    with torch.no_grad():
        for _ in range(new_tokens):
            out = next_logits(running).float()
            total = (scores[:, None] + torch.log_softmax(out, -1)).flatten()
            top = total.topk(beams)
            row, token = top.indices // out.shape[1], top.indices % out.shape[1]
            running, scores = torch.cat([running[row], token[:, None]], 1), top.values
    return running, scores


def full_forward(model):
    """Next-token logits [B, V] of the model's own forward over the whole prefix, no cache."""
    return lambda ids: model(input_ids=ids, use_cache=False).logits[:, -1]
