"""`output.experts: classic | fused`: the same MoE stored either way. The fused output holds
transformers 5's stacks on disk, reads back (moemerge's classic view) to the classic output's
tensors bit for bit, and computes the same logits in transformers. Where a fused output
cannot be read (transformers 4, llama.cpp's converter, a layout with no fused form, a kind
with no token-routed experts) the recipe is refused before any work."""

import json

import pytest
import torch
import transformers
from conftest import TOKEN_ROUTED_FAMILIES, needs_class, perturbed_copy, write_recipe
from moe_families import tensor_names
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from moemerge.api import build
from moemerge.architectures.forms import CLASSIC, FORMS, FUSED
from moemerge.cli import app
from moemerge.errors import MismatchError, RecipeError
from moemerge.io.reader import CheckpointReader

TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
needs_5 = pytest.mark.skipif(not TRANSFORMERS_5, reason="fused stacks need transformers 5")
IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
CLASSES = {"llama": "MixtralForCausalLM", "mistral": "MixtralForCausalLM",
           "qwen2": "Qwen2MoeForCausalLM", "qwen3": "Qwen3MoeForCausalLM",
           "olmo2": "FlexOlmoForCausalLM", "granite": "GraniteMoeForCausalLM"}


def logits(path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def recipe(tmp_path, base, experts, form, extra="",
           routing="experts_per_token: 2\nrouter: {init: random, std: 0.3}"):
    return write_recipe(tmp_path / f"{form}.yaml", "\n".join([
        "kind: moe", f"base_model: {base}", "experts:", *(f"  - {e}" for e in experts),
        f"output: {{experts: {form}}}", routing, extra]) + "\n")


# every source family, and the shared-expert layouts that have a fused form (Qwen2-MoE's
# gated one, GraniteMoeShared's; Llama's shared layout, DeepSeek-MoE, has none: refused below)
CASES = [pytest.param(f, s, marks=needs_class(CLASSES[f]))
         for f, s in [*((f, "none") for f in TOKEN_ROUTED_FAMILIES),
                      ("qwen2", "average"), ("granite", "average")]]


@needs_5
@pytest.mark.parametrize(("family", "shared"), CASES)
def test_a_fused_output_is_the_classic_one_stacked(family, shared, model_factory, tmp_path):
    base = model_factory(family)
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.05, seed=i + 1)
               for i in range(3)]
    outs = {}
    for form in FORMS:
        outs[form] = tmp_path / form
        build(recipe(tmp_path, base, experts, form, f"shared_expert: {shared}"), outs[form],
              progress=False, warn=lambda message: None)
    names = tensor_names_all(outs[FUSED])
    assert any(n.endswith("experts.gate_up_proj") for n in names), names
    assert not any(".experts.0." in n for n in names)
    with CheckpointReader(outs[CLASSIC]) as a, CheckpointReader(outs[FUSED]) as b:
        assert (a.form, b.form) == (CLASSIC, FUSED)
        assert sorted(a.names()) == sorted(b.names())
        assert all(torch.equal(a.read(n), b.read(n)) for n in a.names())
    classic = logits(outs[CLASSIC])
    torch.testing.assert_close(logits(outs[FUSED]), classic, rtol=0, atol=1e-6)
    assert not torch.allclose(classic, logits(experts[0]), atol=1e-3)  # (the MoE's own)
    if shared == "none":  # extract of expert 1 from the stacks: the dense expert's own FFN
        result = CliRunner().invoke(app, ["extract", str(outs[FUSED]), str(tmp_path / "x"),
                                          "--expert", "1"])
        assert result.exit_code == 0, result.output
        got, want = (load_file(path / "model.safetensors") for path in (tmp_path / "x",
                                                                          experts[1]))
        ffn = [n for n in want if ".mlp." in n]
        assert ffn and all(torch.equal(got[n], want[n]) for n in ffn)


def tensor_names_all(path) -> list[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    return tensor_names(path)


@needs_5
def test_a_fused_upcycle(model_factory, tmp_path):
    """Upcycled (each copy sliced in two) into fused stacks."""
    dense = model_factory("llama")
    outs = {}
    for form in FORMS:
        path = write_recipe(tmp_path / f"{form}.yaml", "\n".join([
            "kind: upcycle", f"model: {dense}", "experts: 2", "experts_per_token: 2",
            "granularity: 2", "noise: 0.01", f"output: {{experts: {form}}}"]) + "\n")
        outs[form] = tmp_path / form
        build(path, outs[form], progress=False, warn=lambda message: None)
    with CheckpointReader(outs[CLASSIC]) as a, CheckpointReader(outs[FUSED]) as b:
        assert sorted(a.names()) == sorted(b.names())
        assert all(torch.equal(a.read(n), b.read(n)) for n in a.names())
    torch.testing.assert_close(logits(outs[FUSED]), logits(outs[CLASSIC]), rtol=0, atol=1e-6)


@needs_5
def test_calibrated_routers_land_in_a_fused_output(model_factory, tmp_path):
    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.05, seed=i + 1)
               for i in range(2)]
    text = tmp_path / "calib.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    calibration = (f"router: {{init: calibrate}}\ncalibration: {{data: [{text}], "
                   "max_tokens: 512, seq_len: 32}")
    outs = {}
    for form in FORMS:
        outs[form] = tmp_path / form
        build(recipe(tmp_path, base, experts, form, calibration, "experts_per_token: 2"),
              outs[form], progress=False, warn=lambda message: None)
    with CheckpointReader(outs[CLASSIC]) as a, CheckpointReader(outs[FUSED]) as b:
        router = "model.layers.0.block_sparse_moe.gate.weight"
        assert torch.equal(a.read(router), b.read(router))
        assert torch.equal(a.read(router.replace("0.", "1.", 1)),
                           b.read(router.replace("0.", "1.", 1)))
    assert "model.layers.0.mlp.gate.weight" in tensor_names_all(outs[FUSED])


@needs_5
def test_what_cannot_hold_or_read_stacks_is_refused_before_any_work(model_factory, tmp_path):
    base = model_factory("llama")
    with pytest.raises(MismatchError, match="deepseek layout has no fused form"):
        build(recipe(tmp_path, base, [base, base], FUSED,
                     "layout: deepseek\nshared_expert: base"), tmp_path / "a", progress=False)
    with pytest.raises(RecipeError, match="no token-routed experts to stack"):
        build(recipe(tmp_path, base, [base, base], FUSED, "assembly: merged_experts",
                     routing=""), tmp_path / "b", progress=False)
    result = CliRunner().invoke(app, ["build", str(recipe(tmp_path, base, [base, base], FUSED)),
                                      str(tmp_path / "c"), "--gguf", "f16"])
    assert result.exit_code == 2 and "output.experts: classic" in result.output, result.output
    assert not any((tmp_path / d).exists() for d in "abc")


@pytest.mark.skipif(TRANSFORMERS_5, reason="the refusal is for transformers 4")
def test_fused_is_refused_on_transformers_4(model_factory, tmp_path):
    base = model_factory("llama")
    with pytest.raises(RecipeError, match=r"transformers 4\.\d+\.\d+ reads per-expert"):
        build(recipe(tmp_path, base, [base, base], FUSED), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
