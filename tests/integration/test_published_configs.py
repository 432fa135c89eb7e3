"""Every output kind from sources shaped like the checkpoints people merge: the published
config.json keys (tied embeddings, llama3 rope scaling, Qwen sliding-window keys present but
off, an explicit head_dim ≠ hidden / heads, Granite's multipliers), bf16 weights (OLMo 2: fp32,
as published), shrunk in size only. Identical experts must give the dense model's next-token
distribution, loaded in float32. OLMo 2 and Granite feed token-routed builds only."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_class, write_recipe
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from moemerge.api import build
from moemerge.errors import MismatchError, OutputError
from moemerge.toy.published import published_configs, published_model

SHAPES = {  # shrunk in size only; head_dim as the family has it
    "llama-3.2-1b": {"head_dim": 8},
    "qwen2.5-1.5b": {},
    "qwen3-1.7b": {"head_dim": 16},  # hidden / heads = 8: an explicit, different head_dim
    "mistral-7b-v0.3": {},
    "olmo-2-0425-1b": {},
    "granite-3.1-2b": {},
    # sliding windows shorter than IDS, so local layers differ from global ones
    "gemma-2b": {"head_dim": 16},
    "gemma-2-2b-it": {"head_dim": 16, "sliding_window": 4},
    "gemma-3-1b-pt": {"head_dim": 16, "sliding_window": 4, "sliding_window_pattern": 2},
    "phi-3-mini-4k-instruct": {"sliding_window": 4},
}
TOKEN_ROUTED_ONLY = {"olmo-2-0425-1b": "FlexOlmoForCausalLM",
                     "granite-3.1-2b": "GraniteMoeForCausalLM"}
# moe_target null: no transformers MoE class computes these families
NO_MOE_CLASS = {"gemma-2b", "gemma-2-2b-it", "gemma-3-1b-pt", "phi-3-mini-4k-instruct"}
KINDS = {
    "token_routed": "assembly: token_routed\nexperts_per_token: 2\n",
    "seq_routed_k1": "assembly: seq_routed\nexperts_per_sequence: 1\n",
    "seq_routed_k2": "assembly: seq_routed\nexperts_per_sequence: 2\nrouter: {kind: perplexity}\n",
    "bridged": "assembly: bridged\nexperts_per_sequence: 2\n",
    "merged_experts": "assembly: merged_experts\nsegment_length: 4\n",
}
IDS = torch.randint(4, 300, (2, 11), generator=torch.Generator().manual_seed(0))
CASES = [pytest.param(name, kind, marks=needs_class(TOKEN_ROUTED_ONLY.get(name, "AutoModel")))
         for name in SHAPES for kind in KINDS
         if (name not in TOKEN_ROUTED_ONLY or kind == "token_routed")
         and (name not in NO_MOE_CLASS or kind != "token_routed")]


@pytest.fixture(scope="module")
def published(tmp_path_factory, tokenizer):
    from transformers import CONFIG_MAPPING

    root = tmp_path_factory.mktemp("published")
    made = {}

    def make(name):
        model_type = published_configs()[name]["model_type"]
        if model_type not in CONFIG_MAPPING:
            pytest.skip(f"transformers lacks {model_type}")
        if name not in made:
            made[name] = published_model(
                name, root / name, tokenizer=tokenizer, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=300, **SHAPES[name])
        return made[name]

    return make


def log_probs(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 trust_remote_code=True).eval()
    with torch.no_grad():
        return F.log_softmax(model(input_ids=IDS).logits, -1)


def test_the_sources_are_what_the_hub_has(published):
    """bf16 on disk, no head when tied, the publisher's classic config keys kept."""
    for name in SHAPES:
        path = published(name)
        config = json.loads((path / "config.json").read_text())
        assert config == published_configs()[name] | {  # as published, but shrunk
            k: v for k, v in config.items() if k in SHAPES[name] or k in (
                "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_window_layers", "bos_token_id",
                "eos_token_id", "pad_token_id")}
        dtype = getattr(torch, config["torch_dtype"])
        assert "rope_parameters" not in config
        assert dtype == (torch.float32 if name.startswith("olmo") else torch.bfloat16)
        with safe_open(path / "model.safetensors", "pt") as f:
            names = set(f.keys())
            assert f.get_tensor("model.embed_tokens.weight").dtype == dtype
        # Gemma's configs leave the key out: its config class ties by default
        tied = config.get("tie_word_embeddings",
                          AutoConfig.for_model(config["model_type"]).tie_word_embeddings)
        assert ("lm_head.weight" in names) == (not tied)
    assert published_configs()["llama-3.2-1b"]["rope_scaling"]["rope_type"] == "llama3"


@pytest.mark.parametrize("name,kind", CASES)
def test_identical_experts_give_the_dense_distribution(name, kind, published, tmp_path):
    dense = published(name)
    base = "" if kind == "bridged" else f"base_model: {dense}\n"  # bridged takes no base
    recipe = f"kind: moe\n{base}experts: [{dense}, {dense}]\n{KINDS[kind]}"
    build(write_recipe(tmp_path / "r.yaml", recipe), tmp_path / "out", progress=False)
    ours, theirs = log_probs(tmp_path / "out"), log_probs(dense)
    assert (ours - theirs).abs().max() < 2e-5
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    if kind == "token_routed":  # the rope settings travel in the classic keys
        source = published_configs()[name]
        assert config["rope_theta"] == source["rope_theta"]
        assert config.get("rope_scaling") == source.get("rope_scaling")
        assert config["tie_word_embeddings"] == source["tie_word_embeddings"]


@pytest.mark.parametrize("kind", ["seq_routed_k1", "merged_experts"])
def test_token_routed_only_families_are_refused_elsewhere(kind, published, tmp_path):
    """The shipped modeling code knows pre-norm stacks with a plain head: an OLMo 2 (post-norms)
    or Granite (multipliers) source is an error there, not a silently different model."""
    for name in TOKEN_ROUTED_ONLY:
        dense = published(name)
        recipe = f"kind: moe\nbase_model: {dense}\nexperts: [{dense}, {dense}]\n{KINDS[kind]}"
        with pytest.raises(MismatchError, match="token_routed only"):
            build(write_recipe(tmp_path / "r.yaml", recipe), tmp_path / "out", progress=False)


def test_no_moe_class_is_refused(published, tmp_path):
    """A Gemma 2 cannot become a Mixtral (no GeLU, no (1+w) norms, no softcapping there): the
    build says which kinds it can be instead of writing a model that computes something else."""
    dense = published("gemma-2-2b-it")
    recipe = f"kind: moe\nbase_model: {dense}\nexperts: [{dense}, {dense}]\n{KINDS['token_routed']}"
    with pytest.raises(MismatchError, match="seq_routed, bridged or merged_experts"):
        build(write_recipe(tmp_path / "r.yaml", recipe), tmp_path / "out", progress=False)


def test_bridged_gemma2_beside_llama(published, model_factory, tmp_path):
    """Experts of two families: mixing logits works (each expert softcaps its own); one head on
    mixed hidden states cannot softcap for both, and the build says so."""
    gemma, llama = published("gemma-2-2b-it"), model_factory("llama")
    experts = f"experts: [{gemma}, {llama}]\nexperts_per_sequence: 2\n"
    recipe = f"kind: moe\nassembly: bridged\n{experts}mix: logits\n"
    build(write_recipe(tmp_path / "r.yaml", recipe), tmp_path / "out", progress=False)
    assert torch.isfinite(log_probs(tmp_path / "out")).all()
    recipe = f"kind: moe\nassembly: bridged\n{experts}mix: hidden\n"
    with pytest.raises(OutputError, match="softcap their logits differently"):
        build(write_recipe(tmp_path / "h.yaml", recipe), tmp_path / "out2", progress=False)


@pytest.mark.parametrize("name", ["gemma-3-1b-pt", "phi-3-mini-4k-instruct"])
def test_a_source_saved_by_the_installed_transformers(name, published, tmp_path):
    """transformers 5 writes Gemma 3's rope as one set per layer type (global 1e6, local 1e4)
    and Phi-3's partial_rotary_factor inside rope_parameters too: the output's classic keys keep
    them (the local base alone would move every global layer's rope: max |Δ| 0.024)."""
    import shutil

    dense = shutil.copytree(published(name), tmp_path / "dense")
    if name.startswith("phi"):  # a Phi-4-mini-like partial rope
        values = dict(json.loads((dense / "config.json").read_text()), partial_rotary_factor=0.5)
        (dense / "config.json").write_text(json.dumps(values))
    AutoConfig.from_pretrained(dense).save_pretrained(dense)
    recipe = (f"kind: moe\nbase_model: {dense}\nexperts: [{dense}, {dense}]\n"
              f"{KINDS['seq_routed_k2']}")
    build(write_recipe(tmp_path / "r.yaml", recipe), tmp_path / "out", progress=False)
    assert (log_probs(tmp_path / "out") - log_probs(dense)).abs().max() < 2e-5
