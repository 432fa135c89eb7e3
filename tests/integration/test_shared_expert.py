"""Qwen2-MoE's shared expert (`shared_expert: none | base | average`), checked against the dense
model, and against llama.cpp's way of computing the shared-expert gate."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_class
from safetensors import safe_open
from test_build_moe import logits, moe_recipe
from transformers import AutoModelForCausalLM

from moemerge.api import build
from moemerge.errors import RecipeError

IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
GATE = "model.layers.{}.mlp.shared_expert_gate.weight"


def tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}


def build_qwen2(tmp_path, dense, shared, *, experts=3, k=2, **extra):
    out = tmp_path / f"moe-{shared}"
    notes = []
    build(moe_recipe(tmp_path, dense, [dense] * experts, experts_per_token=k,
                     shared_expert=shared, **extra), out, progress=False, warn=notes.append)
    return out, notes


def llama_cpp_logits(model) -> torch.Tensor:
    """The model's logits with the shared-expert gate computed as llama.cpp's qwen2moe graph
    does: sigmoid(z) as silu(z) / z (the hook hands transformers' sigmoid that value's logit)."""
    def as_llama_cpp(module, inputs, z):
        return torch.logit(F.silu(z) / z)

    hooks = [layer.mlp.shared_expert_gate.register_forward_hook(as_llama_cpp)
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            return model(input_ids=IDS).logits
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("experts,k", [(3, 1), (3, 2), (2, 2)])
def test_no_shared_expert_keeps_identical_experts_parity(experts, k, model_factory, tmp_path):
    dense = model_factory("qwen2")
    out, _ = build_qwen2(tmp_path, dense, "none", experts=experts, k=k)
    config = json.loads((out / "config.json").read_text())
    assert config["shared_expert_intermediate_size"] == 1 and config["norm_topk_prob"] is True
    torch.testing.assert_close(logits(out, IDS), logits(dense, IDS), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("shared,tied", [("base", False), ("average", False), ("base", True)])
def test_shared_expert_adds_its_gated_ffn_to_the_routed_mix(shared, tied, model_factory,
                                                            tmp_path):
    """Identical experts: routed mix = the dense FFN, so each layer's FFN must be
    FFN(x) + sigmoid(g . x) FFN(x), computed here from the dense model's own modules (tied:
    a tied-embedding source with the base's FFN as a fourth expert)."""
    dense = model_factory("qwen2", tie_word_embeddings=tied)
    extra = {"include_base_expert": "true"} if tied else {}
    out, _ = build_qwen2(tmp_path, dense, shared, **extra)
    written = tensors(out)
    reference = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    config = json.loads((out / "config.json").read_text())
    assert config["shared_expert_intermediate_size"] == reference.config.intermediate_size

    def plus_shared(gate):
        def hook(mlp, inputs, output):
            return output * (1 + torch.sigmoid(inputs[0] @ gate.T))
        return hook

    for index, layer in enumerate(reference.model.layers):
        gate = written[GATE.format(index)]
        gates = torch.sigmoid(torch.randn(64, gate.shape[1]) @ gate.T)
        assert ((gates - 0.5).abs() < 0.05).all()  # the documented start: sigmoid ≈ 0.5
        layer.mlp.register_forward_hook(plus_shared(gate))
        shared_up = written[f"model.layers.{index}.mlp.shared_expert.up_proj.weight"]
        exact = 0 if shared == "base" else 1e-7  # an average of 3 equal tensors rounds
        torch.testing.assert_close(shared_up, layer.mlp.up_proj.weight.detach(), atol=exact,
                                   rtol=exact)
    with torch.no_grad():
        expected = reference(input_ids=IDS).logits
    built = logits(out, IDS)
    torch.testing.assert_close(built, expected, atol=2e-5, rtol=1e-4)
    assert (built - logits(dense, IDS)).abs().max() > 1e-2  # the shared expert does add


@pytest.mark.parametrize("shared,dtype", [("none", "float32"), ("base", "float32"),
                                          ("average", "float32"), ("none", "bfloat16")])
def test_llama_cpp_gate_is_finite(shared, dtype, model_factory, tmp_path):
    dense = model_factory("qwen2")
    out, _ = build_qwen2(tmp_path, dense, shared, k=1, output=f"{{dtype: {dtype}}}")
    written = tensors(out)
    gates = [written[GATE.format(i)] for i in range(json.loads(
        (out / "config.json").read_text())["num_hidden_layers"])]
    assert gates and all(g.ne(0).all() for g in gates)  # never zero, bf16 included
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert torch.isfinite(llama_cpp_logits(model)).all()
    # the emulation catches what llama.cpp did with moemerge's old all-zero gate
    for layer in model.model.layers:
        layer.mlp.shared_expert_gate.weight.data.zero_()
    assert torch.isnan(llama_cpp_logits(model)).all()


def test_llama_cpp_top_k_warning(model_factory, tmp_path):
    dense = model_factory("qwen2")
    out, notes = build_qwen2(tmp_path, dense, "none", experts=3, k=2)
    assert len(notes) == 1 and "llama.cpp" in notes[0] and "norm_topk_prob" in notes[0]
    assert notes[0] in (out / "README.md").read_text()
    _, notes = build_qwen2(tmp_path, dense, "base", experts=2, k=2)  # k = N: nothing differs
    assert notes == []
    mixtral = model_factory("llama")
    notes = []
    build(moe_recipe(tmp_path, mixtral, [mixtral] * 3), tmp_path / "mixtral", progress=False,
          warn=notes.append)
    assert notes == []


@pytest.mark.parametrize("family", ["qwen3"])  # (Llama: DeepSeek-MoE, test_deepseek.py)
def test_shared_expert_refused_without_a_shared_expert_layout(family, model_factory, tmp_path):
    dense = model_factory(family)
    with pytest.raises(RecipeError, match="shared_expert: 'base'"):
        build(moe_recipe(tmp_path, dense, [dense, dense], shared_expert="base"),
              tmp_path / "moe", progress=False)


@needs_class("GraniteMoeSharedForCausalLM")
@pytest.mark.parametrize("shared", ["none", "base", "average"])
def test_granite_shared_mlp_is_added_ungated(shared, model_factory, tmp_path):
    """Granite sources: `none` writes a GraniteMoE (no shared MLP, the dense logits); `base` /
    `average` a GraniteMoeShared whose fused shared MLP holds that FFN and is added with no
    gate, so identical experts give each layer's FFN twice: 2 FFN(x)."""
    dense = model_factory("granite")
    out, _ = build_qwen2(tmp_path, dense, shared)
    config = json.loads((out / "config.json").read_text())
    reference = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    if shared == "none":
        assert config["model_type"] == "granitemoe" and "shared_intermediate_size" not in config
    else:
        assert config["model_type"] == "granitemoeshared"
        assert config["shared_intermediate_size"] == reference.config.intermediate_size
        for layer in reference.model.layers:
            layer.mlp.register_forward_hook(lambda _m, _i, output: 2 * output)
        fused = tensors(out)["model.layers.0.shared_mlp.input_linear.weight"]  # [2I, H]
        ffn = reference.model.layers[0].mlp
        exact = 0 if shared == "base" else 1e-7  # an average of 3 equal tensors rounds
        torch.testing.assert_close(fused, torch.cat([ffn.gate_proj.weight, ffn.up_proj.weight]),
                                   atol=exact, rtol=exact)
    with torch.no_grad():
        expected = reference(input_ids=IDS).logits
    built = logits(out, IDS)
    torch.testing.assert_close(built, expected, atol=2e-5, rtol=1e-4)
    if shared != "none":
        # the shared MLP adds (Granite's residual_multiplier keeps the toy FFN's share small:
        # 3e-4 here, 10x what the built model is from the reference)
        added = (built - logits(dense, IDS)).abs().max()
        assert added > 1e-4 and added > 10 * (built - expected).abs().max()
