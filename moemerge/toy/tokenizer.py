"""A byte-level BPE tokenizer trained on the toy corpora, wrapped for transformers.

Byte-level: every string encodes (no unknown characters) and decodes back exactly. Special ids
are fixed so configs can name them: <pad>=0, <s>=1 (bos), </s>=2 (eos), <unk>=3. Encoding adds
no special tokens; callers that want a bos prepend it themselves.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(len(SPECIAL_TOKENS))
MIN_VOCAB = len(SPECIAL_TOKENS) + 256  # specials + the 256 byte symbols


def train_tokenizer(
    texts: list[str], vocab_size: int, *, model_max_length: int = 2048
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE with `vocab_size` entries (specials included) on `texts`.

    Deterministic: the same texts and size give the same vocabulary and merges.
    """
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB} (specials + bytes)")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # GPT-2 splitting: words, numbers and whitespace runs become separate pre-tokens, so merges
    # never cross a word boundary; add_prefix_space=False keeps decode(encode(x)) == x.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def with_added_tokens(src: Path, dst: Path, tokens: list[str], seed: int) -> Path:
    """A copy of the model directory `src` whose tokenizer has `tokens` appended (as added
    tokens), each with N(0, 0.02²) embedding and head rows, and whose config's vocab_size is
    the tokenizer's (rows past the tokenizer dropped): a fine-tune that grew its vocabulary,
    for the tests and the parity benchmark of merges over different vocabularies."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    tok.add_tokens(tokens)
    tok.save(str(dst / "tokenizer.json"))
    size = tok.get_vocab_size(with_added_tokens=True)
    tensors = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            old = tensors[name]
            rows = 0.02 * torch.randn((size, old.shape[1]), generator=gen)
            keep = min(len(old), size)
            rows[:keep] = old[:keep]
            tensors[name] = rows.to(old.dtype)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "vocab_size": size}))
    return dst
