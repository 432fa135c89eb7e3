"""Perplexity against independent oracles: one manual forward, and a uniform-logits model."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from moemerge.errors import CheckpointError
from moemerge.eval.perplexity import (
    perplexity,
    perplexity_table,
    render_table,
    window_counts,
    windows_note,
)
from moemerge.toy.experts import make_random_model
from moemerge.toy.tokenizer import train_tokenizer

torch.set_num_threads(2)
TEXT = "def area(r):\n    return 3.14159 * r * r\n\nThe area of a circle grows with its radius.\n"


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([TEXT * 30], 300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    return make_random_model(
        "llama", tmp_path_factory.mktemp("m") / "llama", vocab=300, tokenizer=tok
    )


def test_matches_one_manual_forward(model_dir, tok):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor(tok(TEXT, add_special_tokens=False)["input_ids"])
    assert 10 < len(ids) < 100
    with torch.no_grad():
        logits = model(input_ids=ids[None, :-1]).logits[0]
    oracle = math.exp(F.cross_entropy(logits, ids[1:]).item())
    # one window over the whole text is the oracle's forward; windowed scores do not depend on
    # how the windows are batched (the short last window included)
    assert perplexity(model, tok, TEXT, seq_len=len(ids)) == pytest.approx(oracle, rel=1e-5)
    windowed = perplexity(model, tok, TEXT, seq_len=7, batch_size=3)
    assert windowed == pytest.approx(
        perplexity(model, tok, TEXT, seq_len=7, batch_size=64), rel=1e-5
    )


def test_prompt_tokens_score_only_the_continuation_through_the_cache(model_dir, tok):
    """Prompt forward, then the rest with the KV cache: the same NLL as one full forward
    restricted to the tokens after ids[prompt]."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor(tok(TEXT, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logits = model(input_ids=ids[None, :-1]).logits[0]
    oracle = math.exp(F.cross_entropy(logits[5:], ids[6:]).item())
    ours = perplexity(model, tok, TEXT, seq_len=len(ids), prompt_tokens=5)
    assert ours == pytest.approx(oracle, rel=1e-5)


def test_uniform_logits_give_the_vocabulary_size(model_dir, tok):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    assert perplexity(model, tok, TEXT * 3, seq_len=16) == pytest.approx(300, rel=1e-5)


def test_max_tokens_limits_the_text(model_dir, tok):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    head = tok.decode(tok(TEXT * 5, add_special_tokens=False)["input_ids"][:40])
    assert perplexity(model, tok, TEXT * 5, seq_len=8, max_tokens=40) == pytest.approx(
        perplexity(model, tok, head, seq_len=8), rel=1e-6
    )


def test_table_and_render(model_dir, tok):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    table = perplexity_table(
        {"path": model_dir, "object": model, "pair": (model, tok)},
        {"a": TEXT, "b": TEXT[::-1]},
        tokenizer=tok,
        seq_len=16,
    )
    assert table["path"] == pytest.approx(table["object"])
    assert table["pair"] == pytest.approx(table["object"])
    rendered = render_table(table, title="t")
    assert [c.header for c in rendered.columns] == ["model", "a", "b", "mean"]
    assert len(rendered.rows) == 3 and "[bold green]" in rendered.rows[0][1]


def test_object_without_tokenizer_or_missing_path_is_refused(model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="tokenizer"):
        perplexity_table({"m": model}, {"a": TEXT})
    with pytest.raises(CheckpointError, match="nowhere"):
        perplexity_table({"m": tmp_path / "nowhere"}, {"a": TEXT})


def test_windows_note_counts_the_windows_perplexity_scores(tok):
    """The line under a perplexity table: 65-token windows with a 32-token prompt score 32
    tokens each; a window too short to hold the prompt and a token to score is not counted."""
    n = len(tok(TEXT * 5, add_special_tokens=False)["input_ids"])
    counts = window_counts(tok, {"a": TEXT * 5, "b": TEXT * 5}, seq_len=64, max_tokens=None,
                           prompt_tokens=32)
    whole, rest = divmod(n, 65)
    assert counts == {"a": whole + (rest >= 34), "b": whole + (rest >= 34)}
    assert window_counts(tok, {"a": TEXT * 5}, seq_len=64, max_tokens=100) == {"a": 2}
    assert windows_note(counts, seq_len=64, max_tokens=20000, prompt_tokens=32) == (
        "perplexity windows: 65 tokens, stride 65 (non-overlapping; the last 32 of each scored, "
        f"the first 32 its prompt), over the first 20000 tokens of each domain: a {counts['a']}, "
        f"b {counts['b']}")
