"""Token-routed MoE builds, checked against the dense models they came from."""

import json

import pytest
import torch
from conftest import (
    TOKEN_ROUTED_FAMILIES,
    llama_cpp_note,
    needs_class,
    perturbed_copy,
    write_recipe,
)
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from moemerge.api import build
from moemerge.architectures import moe_layouts
from moemerge.merge.dispatch import merge
from moemerge.merge.draws import Draws

EXPECTED = {
    "llama": ("MixtralForCausalLM", "mixtral"),
    "mistral": ("MixtralForCausalLM", "mixtral"),
    "qwen2": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "olmo2": ("FlexOlmoForCausalLM", "flex_olmo"),
    "granite": ("GraniteMoeForCausalLM", "granitemoe"),
}
# every source family, skipped where the installed transformers lacks its MoE class
OUTPUTS = [pytest.param(f, marks=needs_class(EXPECTED[f][0])) for f in TOKEN_ROUTED_FAMILIES]
# the tensor that holds expert 1's gate projection of layer 1, by layout
EXPERT_GATE = {
    "mixtral": "model.layers.1.block_sparse_moe.experts.1.w1.weight",
    "granitemoe": "model.layers.1.block_sparse_moe.input_linear.weight",  # [E, 2I, H] gate first
}


def noted(family: str) -> bool:
    """The builds below route top-k of more experts: for a qwen2_moe output moemerge notes that
    llama.cpp's graph does not renormalise the top-k weights (transformers does)."""
    return EXPECTED[family][1] == "qwen2_moe"


def logits(path, ids):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def moe_recipe(tmp_path, base, experts, **extra):
    lines = ["kind: moe", f"base_model: {base}", "experts:"]
    lines += [f"  - {e}" for e in experts]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    return write_recipe(tmp_path / "recipe.yaml", "\n".join(lines) + "\n")


PROMPTS = ["{model: %s, positive_prompts: ['def add(a, b):']}",
           "{model: %s, positive_prompts: ['The sum of two numbers.']}",
           "{model: %s, positive_prompts: ['Q: What is 2 + 3?'], negative_prompts: ['def']}"]


@pytest.mark.parametrize("family", OUTPUTS)
@pytest.mark.parametrize("init", ["random", "task_vector", "prompts", "cheap_embed"])
def test_identical_experts_reproduce_the_dense_logits(family, init, model_factory, tmp_path):
    dense = model_factory(family)
    recipe = moe_recipe(tmp_path, dense, [p % dense for p in PROMPTS],
                        router=f"{{init: {init}}}", include_base_expert="true")
    with llama_cpp_note(noted(family)):
        build(recipe, tmp_path / "moe", progress=False)

    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logits(tmp_path / "moe", ids), logits(dense, ids),
                               atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("family", OUTPUTS)
def test_output_layout_config_and_side_files(family, model_factory, tmp_path):
    base = model_factory(family)
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.01, seed=i) for i in range(2)]
    recipe = moe_recipe(tmp_path, base, experts, experts_per_token=1,
                        output="{max_shard_size: 60KB}")
    out = tmp_path / "moe"
    with llama_cpp_note(noted(family)):
        build(recipe, out, progress=False)

    config = json.loads((out / "config.json").read_text())
    arch, model_type = EXPECTED[family]
    assert config["architectures"] == [arch] and config["model_type"] == model_type
    source = json.loads((base / "config.json").read_text())
    theta = source.get("rope_theta") or source["rope_parameters"]["rope_theta"]
    assert config["rope_theta"] == theta  # the classic key, not Mixtral's 1e6 default
    assert config["torch_dtype"] == "float32" and config["num_experts_per_tok"] == 1
    assert "rope_parameters" not in config and "dtype" not in config
    if model_type in ("mixtral", "granitemoe"):
        assert config["num_local_experts"] == 2
    else:
        assert config["norm_topk_prob"] is True and config["num_experts"] == 2
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                "logits_scaling"):  # Granite's; the MoE class's defaults are all 1.0
        assert config.get(key) == source.get(key)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    for side in ("tokenizer.json", "moemerge_recipe.yaml", "README.md"):
        assert (out / side).is_file(), side
    card = (out / "README.md").read_text()
    # local directories are named in the text, never listed as the hub's base_model
    assert "base_model:" not in card.split("---")[1] and str(experts[0]) in card

    # each expert's FFN arrives untouched under the classic per-expert names
    # (GraniteMoE's are fused: expert 1's gate rows in input_linear[1, :I])
    gate_name = "model.layers.1.mlp.gate_proj.weight"
    expert_name = EXPERT_GATE.get(model_type, "model.layers.1.mlp.experts.1.gate_proj.weight")
    with safe_open(out / index["weight_map"][expert_name], "pt") as f:
        written = f.get_tensor(expert_name)
    with safe_open(experts[1] / "model.safetensors", "pt") as f:
        gate = f.get_tensor(gate_name)
    if written.dim() == 3:
        written = written[1, :gate.shape[0]]
    assert torch.equal(written, gate)

    model = AutoModelForCausalLM.from_pretrained(out)
    generated = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 7)


@pytest.mark.parametrize("family", OUTPUTS)
def test_distinct_experts_match_a_plain_top_k_reference(family, model_factory, tmp_path):
    """Experts that differ in their FFNs only: every layer's MoE block must compute
    sum over the top 2 of 3 experts of w_e FFN_e(x), w the renormalised top-2 of softmax(R x),
    R the written router and FFN_e expert e's own dense FFN, written out here with the dense
    models' modules: pins each layout's expert order, router name and top-k convention, and
    GraniteMoE's fused gate/up rows."""
    base = model_factory(family)
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.05, seed=i, only="mlp")
               for i in range(3)]
    out = tmp_path / "moe"
    with llama_cpp_note(noted(family)):
        build(moe_recipe(tmp_path, base, experts, experts_per_token=2,
                         router="{init: random, std: 0.5}"), out, progress=False)
    layout = moe_layouts()[EXPECTED[family][1]]
    with safe_open(out / "model.safetensors", "pt") as f:
        routers = [f.get_tensor(layout.router_name(i)) for i in range(2)]
    ffns = [AutoModelForCausalLM.from_pretrained(e, dtype=torch.float32).model.layers
            for e in experts]

    def top2(index, router):
        def forward(_mlp, inputs, _output):
            x = inputs[0]  # [B, T, H]
            weights, chosen = torch.softmax(x @ router.T, -1).topk(2, -1)  # [B, T, 2]
            weights = weights / weights.sum(-1, keepdim=True)
            every = torch.stack([ffns[e][index].mlp(x) for e in range(3)], -2)  # [B, T, 3, H]
            picked = every.gather(-2, chosen[..., None].expand(*chosen.shape, x.shape[-1]))
            return (picked * weights[..., None]).sum(-2)
        return forward

    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    for index, layer in enumerate(reference.model.layers):
        layer.mlp.register_forward_hook(top2(index, routers[index]))
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    built = logits(out, ids)
    torch.testing.assert_close(built, expected, atol=2e-5, rtol=1e-4)
    assert (built - logits(base, ids)).abs().max() > 100 * 2e-5  # the experts do differ


def test_non_ffn_tensors_are_the_experts_average(model_factory, tmp_path):
    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.1, seed=i) for i in range(2)]
    build(moe_recipe(tmp_path, base, experts), tmp_path / "moe", progress=False)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors = []
    for path in (*experts, tmp_path / "moe"):
        with safe_open(path / "model.safetensors", "pt") as f:
            tensors.append(f.get_tensor(name))
    torch.testing.assert_close(tensors[2], (tensors[0] + tensors[1]) / 2)


def test_dare_builds_are_bitwise_reproducible(model_factory, tmp_path):
    base = model_factory("qwen3")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.05, seed=i) for i in range(3)]
    recipe = moe_recipe(tmp_path, base, experts, merge="{method: dare_ties, density: 0.5}",
                        seed=7)
    build(recipe, tmp_path / "a", progress=False, lookahead=1)
    build(recipe, tmp_path / "b", progress=False, lookahead=4)
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "model.safetensors").read_bytes()
    recipe.write_text(recipe.read_text().replace("seed: 7", "seed: 8"))
    build(recipe, tmp_path / "c", progress=False)
    assert a != (tmp_path / "c" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("method", ["della", "slerp", "model_stock"])
def test_new_methods_merge_the_shared_tensors(method, model_factory, tmp_path):
    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.1, seed=i) for i in range(2)]
    build(moe_recipe(tmp_path, base, experts, merge=f"{{method: {method}}}", seed=5),
          tmp_path / "moe", progress=False)
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors = []
    for path in (base, *experts, tmp_path / "moe"):
        with safe_open(path / "model.safetensors", "pt") as f:
            tensors.append(f.get_tensor(name))
    expected = merge(method, base=tensors[0], tensors=tensors[1:3],
                     draws=Draws.of(5, name))
    torch.testing.assert_close(tensors[3], expected.to(tensors[3].dtype), atol=0, rtol=0)


def test_bfloat16_output(model_factory, tmp_path):
    base = model_factory("mistral")
    recipe = moe_recipe(tmp_path, base, [base, base], output="{dtype: bfloat16}")
    build(recipe, tmp_path / "moe", progress=False)
    with safe_open(tmp_path / "moe" / "model.safetensors", "pt") as f:
        assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"BF16"}
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("method", ["dare_ties", "ties"])
def test_worker_count_and_row_blocks_do_not_change_the_bytes(method, model_factory, tmp_path,
                                                             monkeypatch):
    """Tensors merged on 1 or 3 threads, read 1 or 5 ahead, give the same file; blocks of 512
    entries make every tensor of the tiny model but the norms several row blocks."""
    import moemerge.merge.blocks as blocks

    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 512)
    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.05, seed=i) for i in range(3)]
    recipe = moe_recipe(tmp_path, base, experts, merge=f"{{method: {method}, density: 0.5}}",
                        seed=3)
    build(recipe, tmp_path / "a", progress=False, workers=1, lookahead=1)
    build(recipe, tmp_path / "b", progress=False, workers=3, lookahead=5)
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "model.safetensors").read_bytes()
    if method == "ties":  # deterministic: the blocked build is the whole-tensor build
        monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 10**9)
        build(recipe, tmp_path / "c", progress=False)
        assert a == (tmp_path / "c" / "model.safetensors").read_bytes()


def test_merge_arithmetic_runs_on_the_chosen_device(monkeypatch):
    """--device moves a merge's inputs to the device and its result back to the host, cast to
    the job's dtype; other jobs never leave the host (checked on the meta device: no GPU)."""
    import moemerge.execute as execute
    from moemerge.plan.jobs import Job, Source
    from moemerge.plan.params import ResolvedMerge

    seen = []

    def spy(method, *, base, tensors, **kwargs):
        seen.append({t.device.type for t in [base, *tensors]})
        return torch.ones(2, 3)

    monkeypatch.setattr(execute, "merge", spy)
    resolved = ResolvedMerge("ties", (("density", 0.5),))
    job = Job("w", (2, 3), torch.bfloat16, "merge", "attn", sources=(Source(1, "w"),
              Source(2, "w")), base=Source(0, "w"), merge=resolved)
    load = lambda s: torch.full((2, 3), float(s.model))  # noqa: E731
    out = execute.compute(job, load, None, 0, device="meta")
    assert seen == [{"meta"}] and out.device.type == "cpu" and out.dtype == torch.bfloat16
    copy = Job("c", (2, 3), torch.float32, "copy", "attn", sources=(Source(2, "w"),))
    assert torch.equal(execute.compute(copy, load, None, 0, device="meta"), load(Source(2, "")))
    with pytest.raises(Exception, match="no CUDA device|not a device|cpu or cuda"):
        execute.check_device("cuda" if not torch.cuda.is_available() else "vulkan")
