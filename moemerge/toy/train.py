"""Tiny causal LMs: seeded random models of every family, and the one loop that trains them.

Training is next-token loss on random windows of token streams. A batch takes its rows from the
streams in turn (row i from stream (i + step) mod n), so a mixture of n domains is weighted
equally whatever their sizes. AdamW with a linear warm-up and a cosine decay to a tenth of the
peak rate; gradients clipped at norm 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from moemerge.loading import quiet_transformers
from moemerge.toy.tokenizer import BOS_ID, EOS_ID, PAD_ID

MAX_THREADS = 2  # the development machines have 2 cores; more threads only spin
MIN_LR_FRACTION = 0.1
_CONFIGS = {  # family -> transformers config class
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "olmo2": "Olmo2Config",  # post-norms, q/k norms over all heads
    "granite": "GraniteConfig",
}
FAMILIES = tuple(_CONFIGS)
ROPE_THETA = 10000.0  # not any family's default, so a lost rope_theta shows up in tests
SLIDING_WINDOW = 256  # mistral only; longer than test sequences, but not the default
# granite only: none is the default 1.0, so a multiplier an output loses shows up in tests
GRANITE_MULTIPLIERS = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                       "attention_multiplier": 0.015625, "logits_scaling": 2.0}


def model_config(
    family: str,
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    tie_word_embeddings: bool = False,
    max_positions: int = 2048,
):
    """A transformers config of `family` (one of FAMILIES) at the given size."""
    import transformers

    if family not in _CONFIGS:
        raise ValueError(f"unknown family {family!r}; known families: {', '.join(FAMILIES)}")
    extra = {"mistral": {"sliding_window": SLIDING_WINDOW},
             "granite": GRANITE_MULTIPLIERS}.get(family, {})
    return getattr(transformers, _CONFIGS[family])(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **extra,
    )


def init_model(config, seed: int) -> torch.nn.Module:
    """A randomly initialised *ForCausalLM for `config`, the same for the same seed; qkv biases
    (qwen2) get N(0, 0.05²) values instead of zeros so tests that drop them notice."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.copy_(0.05 * torch.randn(param.shape, generator=gen))
    return model.eval()


def make_random_model(
    family: str,
    out_dir: Path,
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 64,
    vocab: int = 256,
    seed: int = 0,
    tokenizer=None,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a random `family` checkpoint (and `tokenizer`, if given) to `out_dir`."""
    if tokenizer is not None and len(tokenizer) > vocab:
        raise ValueError(f"vocab={vocab} is smaller than the tokenizer's {len(tokenizer)} tokens")
    config = model_config(
        family,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        vocab=vocab,
        tie_word_embeddings=tie_word_embeddings,
    )
    out_dir = Path(out_dir)
    with quiet_transformers():
        init_model(config, seed).to(dtype).save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def token_stream(tokenizer, text: str) -> torch.Tensor:
    """All token ids of `text`, no special tokens: [N] int64."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def sample_batch(
    streams: Sequence[torch.Tensor], batch: int, seq_len: int, step: int, gen: torch.Generator
) -> torch.Tensor:
    """Random windows of seq_len + 1 tokens (inputs plus shifted labels): [batch, seq_len + 1]."""
    offsets = torch.arange(seq_len + 1)
    rows = []
    for i in range(batch):
        stream = streams[(i + step) % len(streams)]
        if len(stream) <= seq_len + 1:
            raise ValueError(f"a token stream of {len(stream)} tokens is too short for a window")
        start = int(torch.randint(0, len(stream) - seq_len - 1, (1,), generator=gen))
        rows.append(stream[start + offsets])
    return torch.stack(rows)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up to `peak`, then cosine decay to MIN_LR_FRACTION * peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * cosine)


def window_loss(model, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over windows [B, T + 1]."""
    logits = model(input_ids=windows[:, :-1]).logits  # [B, T, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())


def train_lm(
    model: torch.nn.Module,
    streams: Sequence[torch.Tensor],
    *,
    steps: int,
    batch: int,
    seq_len: int,
    lr: float,
    seed: int,
    weight_decay: float = 0.01,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train `model` in place for `steps` steps; returns the loss of every step."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(min(previous_threads, MAX_THREADS))
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    warmup = max(1, min(50, steps // 10))
    losses: list[float] = []
    model.train()
    try:
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, steps, lr, warmup)
            loss = window_loss(model, sample_batch(streams, batch, seq_len, step, gen))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            if on_step is not None:
                on_step(step, losses[-1])
    finally:
        model.eval()
        torch.set_num_threads(previous_threads)
    return losses
