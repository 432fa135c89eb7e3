"""Bridged experts with different tokenizers: the MoE keeps one, the other expert's embedding and
head rows are mapped by token string, tokens it lacks start as the mean of its pieces' rows."""

import pytest
import torch
from conftest import write_recipe
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from moemerge.api import build
from moemerge.errors import MoemergeError
from moemerge.toy.corpora import domain_text
from moemerge.toy.tokenizer import train_tokenizer
from moemerge.toy.train import make_random_model

WIDE, NARROW = 32, 16


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    """(code expert: llama, width 32, a tokenizer trained on code; prose expert: qwen2, width
    16, a tokenizer trained on prose): two real byte-level BPEs from different corpora."""
    root = tmp_path_factory.mktemp("vocab")
    code_tok = train_tokenizer([domain_text("code", 40_000)], vocab_size=420)
    prose_tok = train_tokenizer([domain_text("prose", 40_000)], vocab_size=400)
    code = make_random_model("llama", root / "code", hidden=WIDE, vocab=420, tokenizer=code_tok)
    prose = make_random_model("qwen2", root / "prose", hidden=NARROW, heads=2, kv_heads=1,
                              layers=3, vocab=400, tokenizer=prose_tok, seed=1)
    return code, prose


def bridged(tmp_path, experts, **extra):
    code, prose = experts
    lines = ["kind: moe", "assembly: bridged", "experts:", f"  - {{model: {code}, name: code}}",
             f"  - {{model: {prose}, name: prose}}", "experts_per_sequence: 2",
             *(f"{k}: {v}" for k, v in extra.items())]
    return write_recipe(tmp_path / "recipe.yaml", "\n".join(lines) + "\n")


def test_rows_are_mapped_by_token_string_and_new_tokens_are_means_of_pieces(experts, tmp_path):
    code, prose = experts
    warnings: list[str] = []
    build(bridged(tmp_path, experts, tokenizer="code"), tmp_path / "moe", progress=False,
          warn=warnings.append)
    keep = AutoTokenizer.from_pretrained(code)
    other = AutoTokenizer.from_pretrained(prose)
    assert AutoTokenizer.from_pretrained(tmp_path / "moe").get_vocab() == keep.get_vocab()
    out = load_file(tmp_path / "moe" / "model.safetensors")
    own_code = load_file(code / "model.safetensors")
    own_prose = load_file(prose / "model.safetensors")
    for name, tensor in (("embed_tokens.weight", "model.embed_tokens.weight"),
                         ("lm_head.weight", "lm_head.weight")):
        # the shared row is the average of the code expert's and the prose expert's mapped row,
        # zero-padded to width 32: the mapped row is recovered from the first 16 columns
        mapped = 2 * out[name][:, :NARROW] - own_code[tensor][:, :NARROW]  # [420, 16]
        torch.testing.assert_close(out[name][:, NARROW:], own_code[tensor][:, NARROW:] / 2)
        rows, vocab = own_prose[tensor], other.get_vocab()
        counts = {"shared": 0, "mapped": 0, "new": 0}
        for token, t in keep.get_vocab().items():
            if token in vocab:  # the prose expert's own row for the same string
                torch.testing.assert_close(mapped[t], rows[vocab[token]], atol=1e-6, rtol=0)
                counts["shared" if vocab[token] == t else "mapped"] += 1
                continue
            counts["new"] += 1
            text = keep.decode([t])
            # whole characters, one word: the expert's tokenizer spells the text as one unit
            # (a run of whitespace its pre-tokenizer would split; the map splits no token)
            if text.isascii() and not any(c.isspace() for c in text[1:]):
                pieces = other(text, add_special_tokens=False)["input_ids"]
                assert len(pieces) > 1
                torch.testing.assert_close(mapped[t], rows[pieces].mean(0), atol=1e-6, rtol=0)
        assert all(counts.values()), counts  # every case occurs with these two corpora
    note = next(w for w in warnings if w.startswith("vocabulary:"))
    assert (f"{counts['shared']} shared" in note and f"{counts['mapped']} mapped" in note
            and f"{counts['new']} new" in note and "prose" in note)
    assert note in (tmp_path / "moe" / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", trust_remote_code=True).eval()
    ids = keep("def parse(path):", return_tensors="pt")["input_ids"]
    generated = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, ids.shape[1] + 4)
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape[-1] == 420


def test_the_kept_tokenizer_can_be_named_by_model_and_same_vocabularies_are_not_mapped(
        experts, tmp_path):
    code, prose = experts
    warnings: list[str] = []
    build(bridged(tmp_path, experts, tokenizer=str(prose)), tmp_path / "moe", progress=False,
          warn=warnings.append)
    assert load_file(tmp_path / "moe" / "model.safetensors")["embed_tokens.weight"].shape == (
        400, WIDE)
    assert sum(w.startswith("vocabulary:") and "expert code" in w for w in warnings) == 1
    assert not any("expert prose" in w for w in warnings)


def test_a_missing_tokenizer_and_an_unknown_tokenizer_name_are_errors_naming_field_and_file(
        experts, tmp_path):
    import shutil

    code, prose = experts
    bare = shutil.copytree(prose, tmp_path / "bare")
    (bare / "tokenizer.json").unlink()
    recipe = write_recipe(tmp_path / "r.yaml", "kind: moe\nassembly: bridged\nexperts:\n"
                          f"  - {{model: {code}, name: code}}\n  - {{model: {bare}}}\n")
    with pytest.raises(MoemergeError, match=rf"tokenizer: .*{bare}/tokenizer.json \(bare\) is "
                                            "missing"):
        build(recipe, tmp_path / "moe", progress=False)
    recipe = bridged(tmp_path, experts, tokenizer="poetry")
    with pytest.raises(MoemergeError, match=rf"(?s){recipe}.*tokenizer: 'poetry' is not an "
                                            "expert's name or model"):
        build(recipe, tmp_path / "moe", progress=False)
    assert not (tmp_path / "moe").exists()
