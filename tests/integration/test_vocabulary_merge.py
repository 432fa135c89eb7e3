"""A dense merge over different vocabularies (`tokenizer:`, mergekit's tokenizer merge): the
output tokenizer, and every embedding and head row computed by hand from the models' own rows,
token by token."""

import json

import pytest
import torch
from conftest import perturbed_copy, write_recipe
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from moemerge.api import build
from moemerge.errors import MismatchError, RecipeError
from moemerge.toy import with_added_tokens

ROWS = ("model.embed_tokens.weight", "lm_head.weight")


def rows(model, name: str = ROWS[0]) -> tuple[torch.Tensor, dict[str, int]]:
    """(the model's rows of `name`, its tokenizer's vocabulary)."""
    vocab = Tokenizer.from_file(str(model / "tokenizer.json")).get_vocab(with_added_tokens=True)
    return load_file(model / "model.safetensors")[name].float(), vocab


@pytest.fixture(scope="module")
def three(model_factory, tmp_path_factory):
    """A (the base's own tokenizer), B (+ <think>, </think>), C (+ <think>, QQQ)."""
    root = tmp_path_factory.mktemp("vocab")
    base = model_factory("llama")
    a = perturbed_copy(base, root / "a", scale=0.02, seed=1)
    b = with_added_tokens(perturbed_copy(base, root / "b0", scale=0.02, seed=2), root / "b",
                    ["<think>", "</think>"], seed=3)
    c = with_added_tokens(perturbed_copy(base, root / "c0", scale=0.02, seed=4), root / "c",
                    ["<think>", "QQQ"], seed=5)
    return a, b, c


def merged(tmp_path, text: str, name: str = "out"):
    out = tmp_path / name
    build(write_recipe(tmp_path / f"{name}.yaml", text), out, progress=False)
    return out


def test_union_average_is_each_tokens_mean_over_the_models_that_have_it(three, tmp_path):
    a, b, c = three
    out = merged(tmp_path, f"kind: merge\nmodels: [{a}, {b}, {c}]\nmerge: {{method: average}}\n"
                 "tokenizer: {source: union, pad_to_multiple_of: 8}\n")
    got, vocab = rows(out)
    (ra, va), (rb, vb), (rc, vc) = rows(a), rows(b), rows(c)
    assert list(vocab)[:0] == [] and all(vocab[t] == i for t, i in va.items())  # A's ids kept
    assert [vocab["<think>"], vocab["</think>"], vocab["QQQ"]] == [len(va), len(va) + 1,
                                                                   len(va) + 2]
    tokens = len(va) + 3
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == got.shape[0] == -(-tokens // 8) * 8
    for token, i in vocab.items():
        have = [r[v[token]] for r, v in ((ra, va), (rb, vb), (rc, vc)) if token in v]
        if len(have) == 3:  # in every model: the plain average
            expected = sum(have) / 3
        elif len(have) == 1:  # one model's token: its row stands in for it in the others
            expected = have[0]
        else:  # <think>, in B and C: their mean stands in for it in A
            expected = sum(have) / 2
        torch.testing.assert_close(got[i], expected, atol=1e-6, rtol=1e-5, msg=token)
    torch.testing.assert_close(got[tokens:], got[:tokens].mean(0).expand(got.shape[0] - tokens,
                                                                         -1), atol=1e-6,
                               rtol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == tokens and tokenizer.convert_tokens_to_ids("QQQ") == vocab["QQQ"]
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tokenizer("<think> hello QQQ", return_tensors="pt").input_ids
    assert vocab["QQQ"] in ids[0].tolist()
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3


def test_base_rows_stand_in_and_tokens_block(three, tmp_path):
    """With a base: a token the base has and a model lacks takes the base's row in that model;
    `tokens` adds a zero-row token and forces another's rows from a named token's."""
    a, b, c = three
    out = merged(tmp_path, f"kind: merge\nbase_model: {c}\nmodels: [{a}, {b}]\n"
                 "merge: {method: task_arithmetic, normalize: false, lambda: 1.0}\n"
                 "tokenizer:\n  source: base\n  tokens:\n    '<new>': {source: zero}\n"
                 f"    '</think>': {{source: {{model: {a}, token: e}}, force: true}}\n")
    got, vocab = rows(out)
    (ra, va), (rb, vb), (rc, vc) = rows(a), rows(b), rows(c)
    assert set(vocab) == set(vc) | {"<new>", "</think>"}  # C's tokenizer, the block's tokens
    # out = C + (A - C) + (B - C) = A + B - C row by row, each model's row aligned first
    think = vocab["<think>"]  # C and B have it, A does not: A's row is the base's (C)
    torch.testing.assert_close(got[think], rb[vb["<think>"]], atol=1e-6, rtol=1e-5)
    qqq = vocab["QQQ"]  # C only: A and B take C's row
    torch.testing.assert_close(got[qqq], rc[vc["QQQ"]], atol=1e-6, rtol=1e-5)
    assert got[vocab["<new>"]].abs().max() == 0
    shared = va["e"]
    torch.testing.assert_close(got[vocab["e"]], ra[shared] + rb[vb["e"]] - rc[vc["e"]],
                               atol=1e-6, rtol=1e-5)
    # forced: A's row of "e" in all three models (B's own </think> row is not used)
    torch.testing.assert_close(got[vocab["</think>"]], ra[shared], atol=1e-6, rtol=1e-5)


def test_forced_rows_replace_every_models_own(three, tmp_path):
    a, b, c = three
    out = merged(tmp_path, f"kind: merge\nmodels: [{b}, {c}]\nmerge: {{method: average}}\n"
                 f"tokenizer:\n  tokens:\n    '<think>': {{source: {{model: {b}, token: e}}, "
                 "force: true}\n")
    got, vocab = rows(out)
    rb, vb = rows(b)
    for name in ROWS:
        torch.testing.assert_close(rows(out, name)[0][vocab["<think>"]],
                                   rows(b, name)[0][vb["e"]], atol=0, rtol=0)
    # the comparison can fail: without force each model keeps its own <think> row
    plain = merged(tmp_path, f"kind: merge\nmodels: [{b}, {c}]\nmerge: {{method: average}}\n"
                   "tokenizer: {source: union}\n", "plain")
    assert (rows(plain)[0][vocab["<think>"]] - got[vocab["<think>"]]).abs().max() > 1e-3


def test_without_a_tokenizer_block_different_vocabularies_are_refused(three, tmp_path):
    a, b, _ = three
    with pytest.raises(MismatchError, match="vocab_size"):
        merged(tmp_path, f"kind: merge\nmodels: [{a}, {b}]\nmerge: {{method: average}}\n")
    with pytest.raises(RecipeError, match="tokenizer: model 'x/y' is not one of"):
        merged(tmp_path, f"kind: merge\nmodels: [{a}, {b}]\nmerge: {{method: average}}\n"
               "tokenizer: {source: x/y}\n")


def test_bad_token_sources_and_missing_tokenizers_name_the_problem(three, tmp_path):
    import shutil

    a, b, _ = three
    with pytest.raises(RecipeError, match=r"tokenizer.tokens.<x>: .* has no row for 99999"):
        merged(tmp_path, f"kind: merge\nmodels: [{a}, {b}]\nmerge: {{method: average}}\n"
               f"tokenizer:\n  tokens:\n    '<x>': {{source: {{model: {a}, token_id: 99999}}}}\n")
    with pytest.raises(RecipeError, match="has no such token"):
        merged(tmp_path, f"kind: merge\nmodels: [{a}, {b}]\nmerge: {{method: average}}\n"
               f"tokenizer:\n  tokens:\n    '<x>': {{source: {a}}}\n")
    bare = shutil.copytree(b, tmp_path / "bare")
    (bare / "tokenizer.json").unlink()
    with pytest.raises(RecipeError, match=r"needs each model's tokenizer.json, but .*bare"):
        merged(tmp_path, f"kind: merge\nmodels: [{a}, {bare}]\nmerge: {{method: average}}\n"
               "tokenizer: {source: union}\n")
    assert not (tmp_path / "out").exists()  # nothing written
