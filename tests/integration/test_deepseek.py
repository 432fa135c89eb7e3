"""The DeepSeek-MoE layout (`layout: deepseek`, a Llama base with a shared expert) and a shared
expert taken from another model, against a plainly written reference on distinct experts; and
Qwen2-MoE written from Llama sources (`layout: qwen2_moe`)."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import llama_cpp_note, perturbed_copy
from test_build_moe import logits, moe_recipe
from transformers import AutoModelForCausalLM

from moemerge.api import build
from moemerge.errors import MismatchError, RecipeError
from moemerge.finish.gguf import check_layout_converts
from moemerge.recipe.load import load_recipe

IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
ROUTER = "model.layers.{}.mlp.gate.weight"


def remote(path):
    """The output as its shipped modeling code computes it (trust_remote_code, float32)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                trust_remote_code=True).eval()


def dense(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def ffn(mlp, x):
    """A Llama FFN from its weights: down(silu(gate x) * up x)."""
    return F.linear(F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight),
                    mlp.down_proj.weight)


def reference_logits(base, experts, shared, routers, k, renormalise=True):
    """The base's decoder (the recipe takes its non-FFN tensors) with each layer's FFN replaced
    by Σ_top-k w_e FFN_e(x) + FFN_shared(x), written from the formula: softmax over the router
    logits, the k largest per token, renormalised when k > 1 (DeepSeek's rule), each expert's
    FFN from its own dense model."""
    model = dense(base)
    expert_models = [dense(e) for e in experts]
    shared_model = dense(shared) if shared is not None else None

    def moe(index):
        def forward(x):  # [B, T, H]
            probs = torch.softmax(x @ routers[index].T, dim=-1)
            weights, chosen = probs.topk(k, dim=-1)
            if renormalise and k > 1:
                weights = weights / weights.sum(-1, keepdim=True)
            out = torch.zeros_like(x)
            for b in range(x.shape[0]):
                for t in range(x.shape[1]):
                    for w, e in zip(weights[b, t], chosen[b, t], strict=True):
                        out[b, t] += w * ffn(expert_models[e].model.layers[index].mlp, x[b, t])
            if shared_model is not None:
                out = out + ffn(shared_model.model.layers[index].mlp, x)
            return out
        return forward

    for index, layer in enumerate(model.model.layers):
        layer.mlp.forward = moe(index)
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.fixture(scope="module")
def sources(model_factory, tmp_path_factory):
    """A Llama base, three experts differing from it in their FFNs only, and a fourth model."""
    base = model_factory("llama")
    root = tmp_path_factory.mktemp("deepseek-sources")
    experts = [perturbed_copy(base, root / f"e{i}", scale=0.05, seed=i, only="mlp")
               for i in range(3)]
    return base, experts, perturbed_copy(base, root / "shared", scale=0.05, seed=9, only="mlp")


@pytest.mark.parametrize("k", [1, 2])
def test_shared_model_deepseek_equals_the_reference(k, sources, tmp_path):
    base, experts, shared = sources
    out = tmp_path / "moe"
    with llama_cpp_note():  # top-2 of 3 not renormalised there; top-1 scaled by its weight
        build(moe_recipe(tmp_path, base, experts, experts_per_token=k, merge="{method: base}",
                         shared_expert=f"{{model: {shared}}}"), out, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek" and config["n_routed_experts"] == 3
    assert config["n_shared_experts"] == 1 and config["num_experts_per_tok"] == k
    assert config["moe_intermediate_size"] == config["intermediate_size"]
    assert (out / "modeling_deepseek.py").is_file()
    model = remote(out)
    assert type(model).__name__ == "DeepseekForCausalLM"
    routers = [model.model.layers[i].mlp.gate.weight.detach() for i in range(2)]
    with torch.no_grad():
        built = model(input_ids=IDS).logits
    expected = reference_logits(base, experts, shared, routers, k)
    torch.testing.assert_close(built, expected, atol=2e-5, rtol=1e-4)
    # the comparison can fail: without the shared expert, or with the top-k not renormalised
    assert (reference_logits(base, experts, None, routers, k) - built).abs().max() > 1e-2
    if k == 2:
        unnormalised = reference_logits(base, experts, shared, routers, k, renormalise=False)
        assert (unnormalised - built).abs().max() > 1e-3
    generated = model.generate(IDS[:1], max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, IDS.shape[1] + 4)


def test_deepseek_without_a_shared_expert_is_the_dense_model(model_factory, tmp_path):
    """Identical experts and no shared expert (n_shared_experts null): the dense logits, also
    through moemerge's registered class (no remote code run)."""
    dense_dir = model_factory("llama", tie_word_embeddings=True)
    out = tmp_path / "moe"
    with llama_cpp_note():  # top-2 of 3
        build(moe_recipe(tmp_path, dense_dir, [dense_dir] * 3, layout="deepseek"), out,
              progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["n_shared_experts"] is None
    with torch.no_grad():
        remote_logits = remote(out)(input_ids=IDS).logits
    torch.testing.assert_close(remote_logits, logits(dense_dir, IDS), atol=2e-6, rtol=1e-5)
    from moemerge.modeling import register

    register()
    torch.testing.assert_close(logits(out, IDS), remote_logits, atol=0, rtol=0)
    with pytest.raises(RecipeError, match="needs a shared expert"):
        check_layout_converts(config)


def test_deepseek_trains_its_routers_with_the_balance_loss(sources, tmp_path):
    base, experts, shared = sources
    out = tmp_path / "moe"
    with llama_cpp_note():  # top-2 of 3
        build(moe_recipe(tmp_path, base, experts, shared_expert="base"), out, progress=False)
    model = remote(out).train()
    result = model(input_ids=IDS, labels=IDS, output_router_logits=True)
    assert len(result.router_logits) == 2 and result.router_logits[0].shape == (24, 3)
    assert 0.9 < result.aux_loss.item() < 3.1  # N Σ f_e P_e: 1 when balanced, at most N
    result.loss.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_qwen2_moe_from_llama_sources(model_factory, tmp_path):
    """`layout: qwen2_moe` from a Llama: zero q/k/v biases; identical experts and no shared
    expert give the dense logits; mergekit's shared gate comes from the shared model's prompts."""
    dense_dir = model_factory("llama")
    out = tmp_path / "qwen"
    build(moe_recipe(tmp_path, dense_dir, [dense_dir] * 2, layout="qwen2_moe"), out,
          progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2_moe"
    model = dense(out)
    assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() == 0
    torch.testing.assert_close(logits(out, IDS), logits(dense_dir, IDS), atol=2e-6, rtol=1e-5)


def test_prompted_shared_gate_is_mergekits_row(sources, tmp_path):
    from moemerge.routing.prompts import mergekit_gate_rows

    base, experts, shared = sources
    recipe = moe_recipe(
        tmp_path, base, [f"{{model: {e}, positive_prompts: ['expert {i}']}}"
                         for i, e in enumerate(experts)], layout="qwen2_moe",
        router="{init: mergekit_hidden}",
        shared_expert=f"{{model: {shared}, positive_prompts: ['anything at all']}}")
    out = tmp_path / "qwen"
    with llama_cpp_note():  # qwen2_moe, top-2 of 3
        build(recipe, out, progress=False)
    written = dense(out)
    parsed = load_recipe(recipe)
    rows = mergekit_gate_rows(base, [*parsed.experts, parsed.shared_model], "mergekit_hidden",
                              layers=2)  # [L, 4, H]
    for index, layer in enumerate(written.model.layers):
        torch.testing.assert_close(layer.mlp.gate.weight.detach(), rows[index, :3].float(),
                                   atol=0, rtol=0)
        torch.testing.assert_close(layer.mlp.shared_expert_gate.weight.detach(),
                                   rows[index, 3:].float(), atol=0, rtol=0)
        torch.testing.assert_close(layer.mlp.shared_expert.up_proj.weight,
                                   dense(shared).model.layers[index].mlp.up_proj.weight)


def test_layout_names_and_sources_are_checked(model_factory, tmp_path):
    llama, qwen3 = model_factory("llama"), model_factory("qwen3")
    with pytest.raises(MismatchError, match="layout: 'qwen3_moe' cannot hold a llama model"):
        build(moe_recipe(tmp_path, llama, [llama] * 2, layout="qwen3_moe"), tmp_path / "a",
              progress=False)
    with pytest.raises(MismatchError, match="layout: 'deepseek' cannot hold a qwen3"):
        build(moe_recipe(tmp_path, qwen3, [qwen3] * 2, layout="deepseek"), tmp_path / "b",
              progress=False)
    with pytest.raises(RecipeError, match="shared_expert.*is not none, base or average"):
        build(moe_recipe(tmp_path, llama, [llama] * 2, shared_expert="other"), tmp_path / "c",
              progress=False)


def test_expert_residual_and_noise_scale_and_the_uniform_router(sources, tmp_path):
    """mergekit-moe's expert options: residual_scale multiplies the expert's (and the shared
    expert's) down projection; noise_scale adds N(0, σ²), the same draws for the same recipe;
    router.init uniform draws U(-1/√H, 1/√H)."""
    from safetensors.torch import load_file

    base, experts, shared = sources
    refs = [f"{{model: {experts[0]}, residual_scale: 0.5}}",
            f"{{model: {experts[1]}, noise_scale: 0.05}}", str(experts[2])]
    recipe = moe_recipe(tmp_path, base, refs, shared_expert=f"{{model: {shared}, "
                        "residual_scale: 0.1}", router="{init: uniform}")
    for out in ("a", "b"):
        with llama_cpp_note():  # top-2 of 3
            build(recipe, tmp_path / out, progress=False)
    written = load_file(tmp_path / "a" / "model.safetensors")
    again = load_file(tmp_path / "b" / "model.safetensors")
    assert written.keys() == again.keys() and all(torch.equal(written[k], again[k])
                                                  for k in written)
    own = [load_file(e / "model.safetensors") for e in experts]
    down, gate = "model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.gate_proj.weight"
    expert = "model.layers.1.mlp.experts.{}.{}"
    torch.testing.assert_close(written[expert.format(0, "down_proj.weight")], 0.5 * own[0][down])
    torch.testing.assert_close(written[expert.format(0, "gate_proj.weight")], own[0][gate])
    noise = written[expert.format(1, "gate_proj.weight")] - own[1][gate]
    assert 0.04 < noise.std() < 0.06 and noise.mean().abs() < 0.01
    torch.testing.assert_close(written[expert.format(2, "down_proj.weight")], own[2][down])
    shared_down = load_file(shared / "model.safetensors")[down]
    torch.testing.assert_close(written["model.layers.1.mlp.shared_experts.down_proj.weight"],
                               0.1 * shared_down)
    router = written[ROUTER.format(1)]
    bound = router.shape[1] ** -0.5
    assert router.abs().max() <= bound and router.abs().max() > 0.8 * bound
