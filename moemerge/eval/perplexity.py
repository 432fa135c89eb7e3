"""Perplexity of causal LMs on held-out text, and a table of it per model and domain.

The text is tokenised once (no special tokens) and cut into non-overlapping windows of
seq_len + 1 tokens: each window predicts its last seq_len tokens from the ones before, so every
token but the first of each window is scored exactly once. A trailing partial window is scored
too. Perplexity = exp(mean NLL over all scored tokens), the same for any batch size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.markup import escape

from moemerge.errors import CheckpointError
from moemerge.loading import load_causal_lm, load_pretrained
from moemerge.terminal_tables import Column, Fitted

ModelRef = Path | str | torch.nn.Module | tuple  # a path, a model, or (model, tokenizer)


def _windows(ids: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """Non-overlapping windows of at most seq_len + 1 tokens; the last may be shorter."""
    step = seq_len + 1
    return [ids[i : i + step] for i in range(0, len(ids) - 1, step)]  # each has >= 2 tokens


MAX_TOKENS = 20000  # tokens of each text read by default


def scored_windows(tokenizer, text: str, seq_len: int, max_tokens: int | None,
                    prompt_tokens: int) -> list[torch.Tensor]:
    """The windows [<= seq_len + 1] of `text`'s first `max_tokens` tokens that get scored."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    ids = torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.long)
    if len(ids) < 2 + prompt_tokens:
        raise ValueError(f"perplexity needs a text of at least {2 + prompt_tokens} tokens")
    return [w for w in _windows(ids, seq_len) if len(w) >= 2 + prompt_tokens]


def window_counts(tokenizer, texts: Mapping[str, str], *, seq_len: int = 128,
                  max_tokens: int | None = MAX_TOKENS, prompt_tokens: int = 0) -> dict[str, int]:
    """{domain: number of windows `perplexity` scores on its text} for the same options."""
    return {domain: len(scored_windows(tokenizer, text, seq_len, max_tokens, prompt_tokens))
            for domain, text in texts.items()}


def windows_note(counts: Mapping[str, int], *, seq_len: int, max_tokens: int | None,
                 prompt_tokens: int = 0) -> str:
    """The line under a perplexity table saying which windows it scored: perplexities over
    other windows (another seq_len, prompt or text length) differ for the same model."""
    scored = (f"the last {seq_len - prompt_tokens} of each scored, the first {prompt_tokens} "
              "its prompt" if prompt_tokens else f"the last {seq_len} of each scored")
    read = f"the first {max_tokens} tokens" if max_tokens else "all tokens"
    count = ", ".join(f"{escape(d)} {n}" for d, n in counts.items())
    return (f"perplexity windows: {seq_len + 1} tokens, stride {seq_len + 1} (non-overlapping; "
            f"{scored}), over {read} of each domain: {count}")


@torch.no_grad()
def perplexity(
    model,
    tokenizer,
    text: str,
    *,
    seq_len: int = 128,
    max_tokens: int | None = MAX_TOKENS,
    batch_size: int = 8,
    prompt_tokens: int = 0,
) -> float:
    """exp(mean next-token NLL) of `model` on `text`, using at most `max_tokens` tokens.

    With `prompt_tokens` P, each window is read as generation would: a forward on its first P
    tokens (a prompt; sequence-routed models make their routing decision there), then one on the
    rest with the KV cache; only the tokens after the prompt are scored, for every model alike.
    """
    windows = scored_windows(tokenizer, text, seq_len, max_tokens, prompt_tokens)
    return windows_perplexity(model, windows, batch_size=batch_size, prompt_tokens=prompt_tokens)


@torch.no_grad()
def windows_perplexity(model, windows: list[torch.Tensor], *, batch_size: int = 8,
                       prompt_tokens: int = 0) -> float:
    """`perplexity` on windows already cut (`scored_windows`): a text scored many times
    (`build --tune-on`'s candidates) is tokenised once."""
    model.eval()
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(windows), batch_size):
        chunk = windows[start : start + batch_size]
        for length in sorted({len(w) for w in chunk}):  # the short last window runs alone
            batch = torch.stack([w for w in chunk if len(w) == length]).to(device)  # [B, T + 1]
            logits = _next_token_logits(model, batch[:, :-1], prompt_tokens)  # [B, T - P, V]
            targets = batch[:, 1 + prompt_tokens:]
            nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            total_nll += nll.item()
            total_tokens += targets.numel()
    return math.exp(total_nll / total_tokens)


def _next_token_logits(model, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits [B, T - prompt, V] at positions prompt..T-1 of ids [B, T]: they predict the
    tokens after ids[:, prompt] (the first token after the prompt conditions, unscored)."""
    if not prompt:
        return model(input_ids=ids).logits.float()
    from moemerge.modeling.pretrained_moemerge import CACHE  # transformers' name for it

    first = model(input_ids=ids[:, :prompt], use_cache=True)
    rest = model(input_ids=ids[:, prompt:], use_cache=True, **{CACHE: first[CACHE]})
    return rest.logits.float()


def _load(ref: ModelRef, tokenizer):
    """(model, tokenizer, loaded_here) for a path, a model (needs `tokenizer`) or a pair."""
    if isinstance(ref, (str, Path)):
        model, tokenizer = load_causal_lm(ref)  # moemerge's kinds with the installed code
        return model, tokenizer, True
    if isinstance(ref, tuple):
        return ref[0], ref[1], False
    if tokenizer is None:
        raise ValueError("a model given as an object needs tokenizer=... (or a (model, tok) pair)")
    return ref, tokenizer, False


def load_tokenizer(path: Path):
    try:
        return load_pretrained("AutoTokenizer", path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot load a tokenizer from {path}: {exc}") from None


def perplexity_table(
    models: Mapping[str, ModelRef],
    texts: Mapping[str, str],
    *,
    tokenizer=None,
    **kw,
) -> dict[str, dict[str, float]]:
    """{model label: {domain: perplexity}}; models loaded from paths are freed after use.

    `kw` goes to `perplexity` (seq_len, max_tokens, batch_size). Each model is scored with its
    own tokenizer (the one saved next to it, or `tokenizer` for model objects).
    """
    table: dict[str, dict[str, float]] = {}
    for label, ref in models.items():
        model, tok, loaded_here = _load(ref, tokenizer)
        table[label] = {
            domain: perplexity(model, tok, text, **kw) for domain, text in texts.items()
        }
        if loaded_here:
            del model  # keep one loaded model at a time
    return table


def render_table(
    table: Mapping[str, Mapping[str, float]], title: str | None = None, highlight_best: bool = True
) -> Fitted:
    """Rows = models, columns = domains + mean; the lowest value per column in bold green. As
    many tables as the console's width needs, none cutting a number (moemerge.terminal_tables)."""
    domains = list(next(iter(table.values()), {}))
    rows = {label: [row[d] for d in domains] for label, row in table.items()}
    rows = {label: values + [sum(values) / len(values)] for label, values in rows.items() if values}
    columns = [*domains, "mean"]
    best = [min(values[i] for values in rows.values()) for i in range(len(columns))] if rows else []
    cells = [
        [escape(label)] + [
            f"[bold green]{v:.2f}[/]" if highlight_best and v == best[i] else f"{v:.2f}"
            for i, v in enumerate(values)
        ]
        for label, values in rows.items()
    ]
    return Fitted([Column("model", "left", key=True), *(Column(name) for name in columns)],
                  cells, title=title)
