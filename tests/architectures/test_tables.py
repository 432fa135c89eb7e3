"""Architecture tables: every tensor of every supported family gets a role."""

import pytest

from moemerge.architectures import dense_families, family_for_config, moe_layouts
from moemerge.errors import MismatchError


@pytest.mark.parametrize("name, role, layer, proj", [
    ("model.embed_tokens.weight", "embed", None, None),
    ("lm_head.weight", "lm_head", None, None),
    ("model.norm.weight", "norm", None, None),
    ("model.layers.3.self_attn.q_proj.weight", "attn", 3, None),
    ("model.layers.0.input_layernorm.weight", "norm", 0, None),
    ("model.layers.11.mlp.gate_proj.weight", "ffn", 11, "gate"),
    ("model.layers.11.mlp.up_proj.weight", "ffn", 11, "up"),
    ("model.layers.11.mlp.down_proj.weight", "ffn", 11, "down"),
])
def test_llama_roles(name, role, layer, proj):
    got = dense_families()["llama"].classify(name)
    assert (got.role, got.layer, got.proj) == (role, layer, proj)


def test_unknown_tensor_is_unclassified():
    assert dense_families()["llama"].classify("model.layers.0.mlp.experts.0.w1.weight") is None


def test_qwen_specifics():
    qwen2, qwen3 = dense_families()["qwen2"], dense_families()["qwen3"]
    assert qwen2.classify("model.layers.0.self_attn.q_proj.bias").role == "attn"
    # per-head q/k norms belong to attention: they move with it in role overrides
    assert qwen3.classify("model.layers.0.self_attn.q_norm.weight").role == "attn"


@pytest.mark.parametrize("model_type, family, target", [
    ("llama", "llama", "mixtral"), ("mistral", "llama", "mixtral"),
    ("qwen2", "qwen2", "qwen2_moe"), ("qwen3", "qwen3", "qwen3_moe"),
    ("olmo2", "olmo2", "flex_olmo"), ("granite", "granite", "granitemoe"),
])
def test_family_and_target(model_type, family, target):
    fam = family_for_config({"model_type": model_type}, "x")
    assert (fam.name, fam.moe_target) == (family, target)
    assert target in moe_layouts()


def test_unsupported_model_type_names_the_file():
    with pytest.raises(MismatchError, match=r"m/config\.json: model_type 'gpt2' is not supported"):
        family_for_config({"model_type": "gpt2"}, "m/config.json")


def test_classic_expert_names_on_disk():
    mixtral, qwen = moe_layouts()["mixtral"], moe_layouts()["qwen2_moe"]
    expert = "model.layers.2.block_sparse_moe.experts.1"
    assert mixtral.expert_name(2, 1, "gate") == f"{expert}.w1.weight"
    assert mixtral.expert_name(2, 1, "down") == f"{expert}.w2.weight"
    assert mixtral.router_name(0) == "model.layers.0.block_sparse_moe.gate.weight"
    assert qwen.expert_name(0, 3, "up") == "model.layers.0.mlp.experts.3.up_proj.weight"
    assert qwen.router_name(5) == "model.layers.5.mlp.gate.weight"


def test_every_table_entry_points_at_what_exists():
    """Each family's targets are layouts, its router-input norm is one of its layer tensors,
    each fused tensor joins known projections; a shared target is used only when asked."""
    layouts = moe_layouts()
    for family in dense_families().values():
        assert family.target(False) == family.moe_target
        assert family.moe_target in layouts or family.moe_target is None  # Gemma, Phi-3
        if family.shared_target is not None:
            assert family.target(True) == family.shared_target
            assert layouts[family.shared_target].shared_expert is not None
        norm = family.router_input_norm
        assert norm is None or family.layer_tensors[norm] == "norm"
        assert family.ffn_module == "mlp"
    for layout in layouts.values():
        for projs in (*layout.fused.values(), *layout.fused_shared.values()):
            assert set(projs) <= set(layout.projections)
    assert dense_families()["olmo2"].router_input_norm is None  # OLMo 2's FFN reads no norm
