"""seq_routed and bridged builds, checked against the dense models they came from, loaded
through the modeling code shipped next to the weights (trust_remote_code)."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import FAMILIES, generate_in_fresh_process, perturbed_copy, write_recipe
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from moemerge.api import build
from moemerge.errors import RecipeError

ROUTERS = ("learned", "perplexity", "task_vector")


def load(path, **kw):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                trust_remote_code=True, **kw).eval()


def logits(path, ids, **kw):
    with torch.no_grad():
        return load(path, **kw)(input_ids=ids).logits


def recipe(tmp_path, assembly, experts, base=None, **extra):
    lines = ["kind: moe", f"assembly: {assembly}"] + ([f"base_model: {base}"] if base else [])
    lines += ["experts:", *(f"  - {e}" for e in experts)]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    return write_recipe(tmp_path / "recipe.yaml", "\n".join(lines) + "\n")


IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("router", ROUTERS)
def test_seq_routed_one_expert_is_that_expert(family, router, model_factory, tmp_path):
    base = model_factory(family)
    expert = perturbed_copy(base, tmp_path / "e", scale=0.02, seed=1)
    path = recipe(tmp_path, "seq_routed", [expert], base=base, router=f"{{kind: {router}}}")
    build(path, tmp_path / "moe", progress=False)
    assert torch.equal(logits(tmp_path / "moe", IDS), logits(expert, IDS))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("mix", ["logits", "hidden"])
def test_seq_routed_identical_experts_give_the_dense_distribution(family, router, mix,
                                                                    model_factory, tmp_path):
    dense = model_factory(family)
    experts = [f"{{model: {dense}, name: e{i}, positive_prompts: ['def add']}}" for i in range(3)]
    path = recipe(tmp_path, "seq_routed", experts, base=dense, experts_per_sequence=2, mix=mix,
                  router=f"{{kind: {router}, init: prompts}}" if router == "learned" else
                  f"{{kind: {router}}}")
    build(path, tmp_path / "moe", progress=False)
    ours = F.log_softmax(logits(tmp_path / "moe", IDS), -1)
    torch.testing.assert_close(ours, F.log_softmax(logits(dense, IDS), -1), atol=2e-6, rtol=1e-5)


def test_seq_routed_per_expert_embeddings_and_heads(model_factory, tmp_path):
    base = model_factory("qwen3", tie_word_embeddings=True)
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.05, seed=i) for i in range(2)]
    path = recipe(tmp_path, "seq_routed", [f"{{model: {e}}}" for e in experts], base=base,
                  per_expert="[embed, lm_head]", router="{kind: perplexity}")
    build(path, tmp_path / "moe", progress=False)
    with safe_open(tmp_path / "moe" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {"experts.0.model.embed_tokens.weight", "experts.1.lm_head.weight"} <= names
    assert "embed_tokens.weight" not in names and "lm_head.weight" not in names
    model = load(tmp_path / "moe")
    with torch.no_grad():
        out = model(input_ids=IDS)
    chosen = out.routing_weights.argmax(-1)  # k = 1: each row is exactly its expert's logits
    for row, e in enumerate(chosen.tolist()):
        assert torch.equal(out.logits[row], logits(experts[e], IDS)[row])


def test_generation_keeps_the_prompt_routing_and_matches_the_chosen_expert(model_factory,
                                                                            tmp_path):
    base = model_factory("llama")
    # experts differ in their stacks only, so the merged embedding and head are each expert's
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.3, seed=i, only="layers.")
               for i in range(3)]
    path = recipe(tmp_path, "seq_routed", [str(e) for e in experts], base=base,
                  router="{kind: perplexity}")
    build(path, tmp_path / "moe", progress=False)
    model = load(tmp_path / "moe")
    prompt = IDS[:1]
    with torch.no_grad():
        chosen = int(model(input_ids=prompt).routing_weights.argmax())
    dense = AutoModelForCausalLM.from_pretrained(experts[chosen], dtype=torch.float32).eval()
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    ours = model.generate(prompt, **kw)
    assert torch.equal(ours, dense.generate(prompt, **kw))
    beams = model.generate(prompt, num_beams=3, **kw)  # RoutedCache reorders with the beams
    assert torch.equal(beams, dense.generate(prompt, num_beams=3, **kw))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("hidden", [0, 16])
def test_bridged_one_expert_with_identity_projectors_is_that_expert(family, hidden,
                                                                    model_factory, tmp_path):
    dense = model_factory(family)
    path = recipe(tmp_path, "bridged", [f"{{model: {dense}, name: only}}"],
                  projectors=f"{{hidden_size: {hidden}}}")
    build(path, tmp_path / "moe", progress=False)
    torch.testing.assert_close(logits(tmp_path / "moe", IDS), logits(dense, IDS),
                               atol=1e-6, rtol=1e-5)


def test_bridged_llama_and_narrower_qwen2(model_factory, tmp_path):
    wide = model_factory("llama", hidden=32, layers=2)
    narrow = model_factory("qwen2", hidden=16, layers=3, heads=2, kv_heads=1)
    path = recipe(tmp_path, "bridged",
                  [f"{{model: {wide}, name: wide}}", f"{{model: {narrow}, name: narrow}}"],
                  experts_per_sequence=2, projectors="{hidden_size: 8}")
    build(path, tmp_path / "moe", progress=False)
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert config["hidden_size"] == 32 and config["auto_map"]["AutoModelForCausalLM"]
    with safe_open(tmp_path / "moe" / "model.safetensors", "pt") as f:
        shapes = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    assert shapes["embed_tokens.weight"] == (300, 32) and shapes["router.weight"] == (2, 32)
    assert shapes["experts.1.proj_in.linear.weight"] == (16, 32)
    assert shapes["experts.1.proj_out.down.weight"] == (32, 8)
    assert "experts.1.model.layers.2.self_attn.q_proj.bias" in shapes
    model = load(tmp_path / "moe")
    out = model.generate(IDS[:1], max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 17)
    with torch.no_grad():
        result = model(input_ids=IDS)
    assert result.logits.shape == (2, 12, 300)
    assert torch.allclose(result.routing_weights.sum(-1), torch.ones(2))


def test_bridged_experts_with_more_padding_rows_keep_every_token_row(model_factory, tmp_path):
    """One tokenizer, vocab_size 300 and 320: the map keeps each token's row (all shared)."""
    a = model_factory("llama")
    b = model_factory("qwen2", vocab=320)
    path = recipe(tmp_path, "bridged", [str(a), str(b)])
    notes: list[str] = []
    build(path, tmp_path / "moe", progress=False, warn=notes.append)
    tokens = len(AutoTokenizer.from_pretrained(a))
    counts = f"{tokens} shared, 0 mapped, 0 new" + (f", {300 - tokens} padding"
                                                     if tokens < 300 else " (")
    assert any(counts in n for n in notes), notes
    with safe_open(tmp_path / "moe" / "model.safetensors", "pt") as f:
        shared = f.get_tensor("embed_tokens.weight")
    with safe_open(a / "model.safetensors", "pt") as f:
        own_a = f.get_tensor("model.embed_tokens.weight")
    with safe_open(b / "model.safetensors", "pt") as f:
        own_b = f.get_tensor("model.embed_tokens.weight")
    assert shared.shape == own_a.shape
    torch.testing.assert_close(shared[:tokens], (own_a[:tokens] + own_b[:tokens]) / 2)


def test_k_larger_than_the_experts_is_a_recipe_error(model_factory, tmp_path):
    dense = model_factory("llama")
    path = recipe(tmp_path, "seq_routed", [str(dense)], experts_per_sequence=2)
    with pytest.raises(RecipeError, match="experts_per_sequence: 2 is larger than the number "
                                          r"of experts \(1\)"):
        build(path, tmp_path / "moe", progress=False)


def test_a_projector_that_does_not_fit_its_expert_names_the_tensor(model_factory, tmp_path):
    wide, narrow = model_factory("llama"), model_factory("llama", hidden=16, heads=2, kv_heads=1)
    path = recipe(tmp_path, "bridged", [str(wide), str(narrow)])
    build(path, tmp_path / "moe", progress=False)
    config_file = tmp_path / "moe" / "config.json"
    config = json.loads(config_file.read_text())
    config["experts"][1]["intermediate_size"] *= 2  # the checkpoint no longer fits the config
    config["experts"][1]["hidden_size"] = 24
    config_file.write_text(json.dumps(config))
    with pytest.raises(Exception, match=r"experts\.1\.(proj|model)"):
        load(tmp_path / "moe")


@pytest.mark.parametrize("assembly", ["seq_routed", "bridged"])
def test_a_fresh_offline_process_loads_the_shipped_code_and_generates(assembly, model_factory,
                                                                       tmp_path):
    dense = model_factory("qwen2")
    path = recipe(tmp_path, assembly, [str(dense), str(dense)])
    build(path, tmp_path / "moe", progress=False)
    for name in ("configuration_moemerge.py", "routing_moemerge.py", "modeling_moemerge.py"):
        assert "import moemerge" not in (tmp_path / "moe" / name).read_text()
    assert generate_in_fresh_process(tmp_path / "moe", tmp_path) == ["8", assembly]


def test_lstsq_projectors_fit_each_expert_to_the_shared_embedding_and_head(model_factory,
                                                                            tmp_path):
    """Least squares, checked against its definition: proj-in maps the shared embedding to the
    expert's own, and no other linear map does better; with one expert it is the identity."""
    from safetensors.torch import load_file

    wide = model_factory("llama")
    narrow = model_factory("qwen2", hidden=16, heads=2, kv_heads=1)
    path = recipe(tmp_path, "bridged", [str(wide), str(narrow)], projectors="{init: lstsq}")
    build(path, tmp_path / "moe", progress=False)
    out = load_file(tmp_path / "moe" / "model.safetensors")
    own = load_file(narrow / "model.safetensors")["model.embed_tokens.weight"]  # [V, 16]
    shared = out["embed_tokens.weight"].double()  # [V, 32]
    fitted = out["experts.1.proj_in.linear.weight"].double()  # [16, 32]
    residual = (shared @ fitted.T - own).norm()
    nudged = fitted + 1e-3 * torch.randn(fitted.shape, dtype=torch.float64)
    assert residual < (shared @ nudged.T - own).norm()
    # the normal equations: the residual is orthogonal to the shared embedding's columns
    assert (shared.T @ (shared @ fitted.T - own)).abs().max() < 1e-6 * shared.norm() ** 2

    path = recipe(tmp_path, "bridged", [str(wide)], projectors="{init: lstsq}")
    build(path, tmp_path / "one", progress=False)
    torch.testing.assert_close(logits(tmp_path / "one", IDS), logits(wide, IDS),
                               atol=1e-4, rtol=1e-4)
