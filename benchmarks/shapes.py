"""Random-weight checkpoints with the real shapes of published models, made offline and cached.

    python benchmarks/shapes.py llama-3.2-1b [--experts 4] [--layers N] [--cache DIR]

For a published config (moemerge/toy/published_configs.json: llama-3.2-1b, qwen2.5-1.5b,
qwen3-1.7b, mistral-7b-v0.3) writes a base and `experts` fine-tune stand-ins under
`DIR/<name>[-<N>L]/{base,e0,e1,...}`, each with

- config.json: the publisher's, verbatim (only `num_hidden_layers` changed with `--layers`);
- weights in bf16, every tensor at its real shape, named as transformers names them (tensor
  list from the model class on the meta device; `lm_head.weight` absent when tied, as on the
  hub), written with moemerge's streaming sharded writer in shards of SHARD_BYTES[name]
  (hub-like: the 1B/1.5B checkpoints are one file, Qwen3-1.7B two; the 8-layer Mistral, 4 GB,
  three of at most 2 GB, so that it is sharded as the full 14.5 GB one is);
- a real-size tokenizer: a byte-level BPE trained with `tokenizers` on this Python's stdlib
  sources (TOKENIZER_TEXT_BYTES of it) to the first special id of the config (128000 for Llama
  3, 151643 for Qwen, the whole 32768 for Mistral), then padded with named special tokens
  (`<|begin_of_text|>`/`<|end_of_text|>`/`<|endoftext|>` at the config's bos/eos ids,
  `<|reserved_special_token_i|>` elsewhere) to exactly `vocab_size`. If the BPE stops short of
  its target (too little text for that many merges), the padding covers the rest; the actual
  number of learned tokens is recorded in the cache's `made.json`.

Base values: N(0, 0.02²) matrices and embeddings, norms 1 + N(0, 0.02²), biases N(0, 0.02²).
Expert e = base + Δ_e with Δ_e per tensor (seeded by set, expert and tensor name) the sum of
  low rank:  U V^T, rank 8, entries scaled to std 2e-3 (a LoRA-like fine-tune direction),
  sparse:    1% of the entries moved by N(0, 0.01²) (a few large outlier updates),
  dense:     N(0, 5e-4²) (the small everywhere drift);
so task vectors have the magnitude structure TIES trims and DARE drops. Vectors (norms,
biases) get the dense part only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from moemerge.io.writer import ShardedWriter  # noqa: E402
from moemerge.toy.published import published_configs, shrunk_config  # noqa: E402

DEFAULT_CACHE = Path("/tmp/moemerge-scale")
SHARD_BYTES = {"llama-3.2-1b": 5 * 10**9, "qwen2.5-1.5b": 5 * 10**9,
               "qwen3-1.7b": 3 * 10**9, "mistral-7b-v0.3": 2 * 10**9}
TOKENIZER_TEXT_BYTES = 12 * 10**6
LOW_RANK, LOW_RANK_STD, SPARSE_FRACTION, SPARSE_STD, DENSE_STD = 8, 2e-3, 0.01, 1e-2, 5e-4


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def tensor_list(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor the hub checkpoint of `config` holds, in module order."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in config.items()
              if k not in ("architectures", "model_type", "torch_dtype", "transformers_version")}
    hf_config = AutoConfig.for_model(config["model_type"], **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    names = [(n, tuple(p.shape)) for n, p in model.state_dict().items()]
    if config.get("tie_word_embeddings"):
        names = [(n, s) for n, s in names if n != "lm_head.weight"]
    return names


def base_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    values = torch.randn(shape, generator=gen).mul_(0.02)
    if name.endswith("norm.weight"):
        values.add_(1.0)
    return values


def delta(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """One expert's Δ for one tensor (fp32): low rank + sparse + dense (see the module doc)."""
    out = torch.randn(shape, generator=gen).mul_(DENSE_STD)
    if len(shape) == 2:
        rows, cols = shape
        u = torch.randn(rows, LOW_RANK, generator=gen)
        v = torch.randn(LOW_RANK, cols, generator=gen)
        out.addmm_(u, v, alpha=LOW_RANK_STD / LOW_RANK**0.5)
        flat = out.view(-1)
        picked = torch.randint(flat.numel(), (int(flat.numel() * SPARSE_FRACTION),), generator=gen)
        flat.index_add_(0, picked, torch.randn(picked.numel(), generator=gen).mul_(SPARSE_STD))
    return out


def make_tokenizer(config: dict, out_dir: Path) -> dict:
    """Train the padded byte-level BPE for `config` into `out_dir` (see the module doc)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    vocab = config["vocab_size"]
    ids = {k: config.get(k) for k in ("bos_token_id", "eos_token_id")}
    high = [i for i in ids.values() if isinstance(i, int) and i >= 1000]
    target = min(high) if high else vocab
    text_dir = Path(json.__file__).resolve().parent.parent  # the stdlib
    texts, size = [], 0
    for file in sorted(text_dir.glob("**/*.py")):
        if size >= TOKENIZER_TEXT_BYTES:
            break
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        size += len(text)
    low_specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=target, min_frequency=1, show_progress=False,
                                  special_tokens=low_specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    learned = tok.get_vocab_size()
    named = {ids["bos_token_id"]: "<|begin_of_text|>" if config["model_type"] == "llama"
             else "<|im_start|>",
             ids["eos_token_id"]: "<|end_of_text|>" if config["model_type"] == "llama"
             else "<|endoftext|>"}
    pad = [named.get(i, f"<|reserved_special_token_{i - learned}|>") for i in range(learned, vocab)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in pad])
    assert tok.get_vocab_size() == vocab, (tok.get_vocab_size(), vocab)
    bos = named.get(ids["bos_token_id"], "<s>") if ids["bos_token_id"] is not None else None
    eos = named.get(ids["eos_token_id"], "</s>")
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                      unk_token="<unk>", clean_up_tokenization_spaces=False,
                                      model_max_length=config.get("max_position_embeddings"))
    wrapped.save_pretrained(out_dir)
    return {"learned_tokens": learned, "bpe_target": target, "vocab_size": vocab,
            "text_bytes": size}


def write_model(out_dir: Path, config: dict, tensors: list[tuple[str, tuple[int, ...]]],
                shard_bytes: int, set_seed: int, expert: int | None,
                tokenizer_dir: Path) -> None:
    out_dir.mkdir(parents=True)
    planned = [(n, torch.bfloat16, s) for n, s in tensors]
    with ShardedWriter(out_dir, planned, max_shard_bytes=shard_bytes) as writer:
        for name, shape in tensors:
            value = base_tensor(name, shape, torch.Generator().manual_seed(_seed(set_seed, name)))
            if expert is not None:
                gen = torch.Generator().manual_seed(_seed(set_seed, expert, name))
                value.add_(delta(shape, gen))
            writer.write(name, value.to(torch.bfloat16))
            del value
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in tokenizer_dir.iterdir():
        shutil.copyfile(file, out_dir / file.name)


def make_shape_set(name: str, experts: int = 4, *, layers: int | None = None,
                   cache: Path = DEFAULT_CACHE, seed: int = 0) -> dict:
    """Make (or find in `cache`) the base and `experts` experts of shape `name`; returns
    {"dir", "base", "experts", "made": {timings, sizes}}."""
    if name not in published_configs():
        raise SystemExit(f"unknown shape {name!r}; one of {sorted(published_configs())}")
    config = shrunk_config(name, num_hidden_layers=layers) if layers else \
        dict(published_configs()[name])
    root = Path(cache) / (f"{name}-{layers}L" if layers else name)
    made_file = root / "made.json"
    made = json.loads(made_file.read_text()) if made_file.is_file() else {}
    models = ["base", *(f"e{i}" for i in range(experts))]
    if made.get("seed") != seed:
        shutil.rmtree(root, ignore_errors=True)
        made = {"seed": seed, "seconds": {}}
    root.mkdir(parents=True, exist_ok=True)
    tensors = tensor_list(config)
    tok_dir = root / "tokenizer"
    if "tokenizer" not in made:
        shutil.rmtree(tok_dir, ignore_errors=True)
        t0 = time.perf_counter()
        made["tokenizer"] = make_tokenizer(config, tok_dir)
        made["seconds"]["tokenizer"] = round(time.perf_counter() - t0, 1)
        made_file.write_text(json.dumps(made, indent=2) + "\n")
    for i, model in enumerate(models):
        if model in made["seconds"]:
            continue
        shutil.rmtree(root / model, ignore_errors=True)
        t0 = time.perf_counter()
        write_model(root / model, config, tensors, SHARD_BYTES[name], seed,
                    None if model == "base" else i - 1, tok_dir)
        made["seconds"][model] = round(time.perf_counter() - t0, 1)
        made_file.write_text(json.dumps(made, indent=2) + "\n")
    made["params"] = sum(torch.Size(s).numel() for _, s in tensors)
    made["largest_tensor_bytes"] = max(torch.Size(s).numel() * 2 for _, s in tensors)
    made["model_bytes"] = made["params"] * 2
    made["shards"] = len(list((root / "base").glob("*.safetensors")))
    made_file.write_text(json.dumps(made, indent=2) + "\n")
    return {"dir": str(root), "base": str(root / "base"),
            "experts": [str(root / m) for m in models[1:]], "made": made}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=sorted(published_configs()))
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--layers", type=int, help="keep this many layers (every tensor at "
                        "its real shape); the published depth otherwise")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    made = make_shape_set(opts.name, opts.experts, layers=opts.layers, cache=opts.cache,
                          seed=opts.seed)
    print(json.dumps(made, indent=2))


if __name__ == "__main__":
    main()
