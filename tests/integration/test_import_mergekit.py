"""`moemerge import-mergekit` then `moemerge build`: mergekit-shaped configs on tiny models."""

import pytest
import torch
from conftest import perturbed_copy, write_recipe
from safetensors.torch import load_file
from typer.testing import CliRunner

from moemerge.cli import app
from moemerge.merge.dispatch import merge
from moemerge.merge.primitives import generator_for

runner = CliRunner()


@pytest.fixture
def trio(model_factory, tmp_path):
    base = model_factory("llama")
    return base, [perturbed_copy(base, tmp_path / f"m{i}", scale=0.05, seed=i) for i in range(2)]


def import_and_build(tmp_path, config_text):
    config = write_recipe(tmp_path / "mergekit.yml", config_text)
    result = runner.invoke(app, ["import-mergekit", str(config), "-o", str(tmp_path / "r.yaml")])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["build", str(tmp_path / "r.yaml"), str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
    return load_file(tmp_path / "out" / "model.safetensors")


def test_dare_ties_config_builds_with_mergekits_conventions(trio, tmp_path):
    base, (a, b) = trio
    out = import_and_build(tmp_path, f"""
models:
  - model: {base}
  - model: {a}
    parameters: {{density: 0.5, weight: 0.4}}
  - model: {b}
    parameters: {{density: 0.5, weight: 0.3}}
merge_method: dare_ties
base_model: {base}
parameters: {{int8_mask: true}}
dtype: float32
""")
    tensors = [load_file(p / "model.safetensors") for p in (base, a, b)]
    name = "model.layers.0.mlp.up_proj.weight"
    expected = merge("dare_ties", base=tensors[0][name], tensors=[t[name] for t in tensors[1:]],
                     weights=[0.4, 0.3], density=0.5, normalize=False, zero_vote="positive",
                     rescale="l1", generator=generator_for(0, name))
    torch.testing.assert_close(out[name], expected, atol=0, rtol=0)


def test_slerp_slices_config_builds(trio, tmp_path):
    base, (a, b) = trio
    out = import_and_build(tmp_path, f"""
slices:
  - sources:
      - model: {b}
        layer_range: [0, 2]
      - model: {a}
        layer_range: [0, 2]
merge_method: slerp
base_model: {a}
parameters:
  t:
    - filter: self_attn
      value: [0, 1]
    - value: 0
dtype: float32
""")
    # the base (a) is t = 0: attention goes from a (layer 0) to b (layer 1), the rest stays a
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    for name, source in (("model.layers.0.self_attn.q_proj.weight", ta),
                         ("model.layers.1.self_attn.q_proj.weight", tb),
                         ("model.layers.1.mlp.up_proj.weight", ta)):
        torch.testing.assert_close(out[name], source[name], atol=1e-6, rtol=0)


def test_mergekit_moe_config_builds_a_mixtral(trio, tmp_path):
    base, (a, b) = trio
    out = import_and_build(tmp_path, f"""
base_model: {base}
gate_mode: cheap_embed
experts:
  - source_model: {a}
    positive_prompts: ["def add(a, b):"]
  - source_model: {b}
    positive_prompts: ["The sum of two numbers."]
""")
    source = load_file(base / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(out[name], source[name])  # mergekit-moe copies the base's attention
    assert "model.layers.0.block_sparse_moe.experts.1.w1.weight" in out


def test_prints_without_output_and_refuses_an_existing_file(trio, tmp_path):
    base, (a, b) = trio
    config = write_recipe(tmp_path / "c.yml", f"models: [{{model: {a}}}, {{model: {b}}}]\n"
                          "merge_method: linear\n")
    result = runner.invoke(app, ["import-mergekit", str(config)])
    assert result.exit_code == 0 and "method: average" in result.output
    existing = write_recipe(tmp_path / "r.yaml", "x")
    result = runner.invoke(app, ["import-mergekit", str(config), "-o", str(existing)])
    assert result.exit_code == 1 and "already exists" in result.output
    bad = write_recipe(tmp_path / "bad.yml", "merge_method: nuslerp\nmodels: [{model: x}]\n")
    result = runner.invoke(app, ["import-mergekit", str(bad)])
    assert result.exit_code == 2 and "nuslerp" in result.output
