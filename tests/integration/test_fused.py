"""Phi-3's fused projections: a merge of qkv_proj is made on q, k and v apart and stacked again,
as the same method merges an unfused family's q_proj, k_proj, v_proj; merged_experts splits
gate_up_proj into its gate and up experts."""

import pytest
import torch
from conftest import TEXT, perturbed_copy, write_recipe
from safetensors.torch import load_file
from transformers import CONFIG_MAPPING

from moemerge.api import build
from moemerge.eval.perplexity import perplexity
from moemerge.loading import load_causal_lm
from moemerge.merge.dispatch import merge
from moemerge.toy.published import published_model
from moemerge.tune import TuneOptions

SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}
QKV = "model.layers.1.self_attn.qkv_proj.weight"
PARTS = {"q": (0, 32), "k": (32, 48), "v": (48, 64)}  # 4 heads, 2 kv heads of 8


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, tokenizer):
    if "phi3" not in CONFIG_MAPPING:
        pytest.skip("transformers lacks phi3")
    root = tmp_path_factory.mktemp("phi3")
    base = published_model("phi-3-mini-4k-instruct", root / "base", tokenizer=tokenizer, **SHAPE)
    return base, [perturbed_copy(base, root / f"e{i}", scale=0.05, seed=30 + i)
                  for i in range(2)]


def tensors(path):
    return {k: v.float() for k, v in load_file(next(path.glob("*.safetensors"))).items()}


def test_qkv_is_merged_part_by_part(phi3, tmp_path):
    base, experts = phi3
    recipe = (f"kind: merge\nbase_model: {base}\nmodels: [{experts[0]}, {experts[1]}]\n"
              "merge: {method: ties, density: 0.3}\noutput: {dtype: float32}\n")
    build(write_recipe(tmp_path / "r.yaml", recipe), tmp_path / "out", progress=False)
    out = tensors(tmp_path / "out")[QKV]
    b, ts = tensors(base)[QKV], [tensors(e)[QKV] for e in experts]

    def ties(rows):
        return merge("ties", base=b[slice(*rows)], tensors=[t[slice(*rows)] for t in ts],
                     density=0.3)

    expected = torch.cat([ties(rows) for rows in PARTS.values()])
    assert (out - expected).abs().max() < 1e-6
    # TIES on the fused tensor trims at one threshold for q, k and v: a different result
    assert (out - ties((0, 64))).abs().max() > 1e-3


def test_tune_on_reaches_the_fused_parts(phi3, tmp_path):
    """`build --tune-on` varies a fused tensor's parts with their role while it searches, so
    the model it scores is the model it builds: the built model's perplexity is the tuned one
    (when the search left gate_up_proj at the recipe's values, the build, which applies the
    chosen values to every ffn tensor, scored 300.96 where the search reported 302.58), and its
    gate_up_proj is gate and up
    merged apart at the values chosen for ffn (measured: λ 0.3, density 0.9; the recipe says
    λ 1.0)."""
    base, experts = phi3
    recipe = (f"kind: merge\nbase_model: {base}\nmodels: [{experts[0]}, {experts[1]}]\n"
              "merge: {method: ties, density: 0.9, lambda: 1.0}\noutput: {dtype: float32}\n")
    held_out = write_recipe(tmp_path / "held_out.txt", TEXT * 12)
    opts = TuneOptions(held_out, lambdas=(0.3, 1.0), densities=(0.5, 0.9), max_tokens=264,
                       seq_len=32)
    result = build(write_recipe(tmp_path / "r.yaml", recipe), tmp_path / "out", progress=False,
                   tune=opts).tuning
    assert result.chosen.get("ffn", (1.0, 0.9)) != (1.0, 0.9), result.chosen
    name, parts = "model.layers.1.mlp.gate_up_proj.weight", ((0, 64), (64, 128))
    out = tensors(tmp_path / "out")[name]
    b, ts = tensors(base)[name], [tensors(e)[name] for e in experts]

    def ties(lam: float, density: float) -> torch.Tensor:
        return torch.cat([merge("ties", base=b[slice(*rows)], tensors=[t[slice(*rows)] for t in ts],
                                density=density, **{"lambda": lam}) for rows in parts])

    assert (out - ties(*result.chosen["ffn"])).abs().max() < 1e-6
    assert (out - ties(1.0, 0.9)).abs().max() > 1e-3
    model, tok = load_causal_lm(tmp_path / "out")
    assert perplexity(model, tok, held_out.read_text(), seq_len=32, max_tokens=264) == (
        pytest.approx(result.tuned, rel=1e-6))


def test_merged_experts_split_gate_up(phi3, tmp_path):
    base, experts = phi3
    recipe = (f"kind: moe\nassembly: merged_experts\nbase_model: {base}\n"
              f"experts: [{experts[0]}, {experts[1]}]\n")
    build(write_recipe(tmp_path / "r.yaml", recipe), tmp_path / "out", progress=False)
    out = tensors(tmp_path / "out")
    fused = tensors(experts[1])["model.layers.0.mlp.gate_up_proj.weight"]
    mlp = "model.layers.0.mlp.experts.1"
    assert torch.equal(out[f"{mlp}.gate_proj.weight"], fused[:64])  # gate rows first
    assert torch.equal(out[f"{mlp}.up_proj.weight"], fused[64:])
    assert not any("gate_up_proj" in name for name in out)
