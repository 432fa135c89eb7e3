"""Dense merges through the whole pipeline match the pure merge functions."""

import json

import pytest
import torch
from conftest import perturbed_copy, write_recipe
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from moemerge.api import build
from moemerge.errors import MismatchError
from moemerge.merge import methods, sphere
from moemerge.merge.dispatch import merge
from moemerge.merge.draws import Draws


@pytest.fixture
def trio(model_factory, tmp_path):
    base = model_factory("qwen2")
    return base, [perturbed_copy(base, tmp_path / f"m{i}", scale=0.05, seed=i) for i in range(2)]


def merged(tmp_path, recipe_text):
    recipe = write_recipe(tmp_path / "merge.yaml", recipe_text)
    build(recipe, tmp_path / "out", progress=False)
    return load_file(tmp_path / "out" / "model.safetensors")


def test_average_of_a_model_with_itself_is_the_model(model_factory, tmp_path):
    base = model_factory("llama")
    out = merged(tmp_path, f"kind: merge\nmodels: [{base}, {base}]\n")
    source = load_file(base / "model.safetensors")
    assert out.keys() == source.keys()
    assert all(torch.equal(out[k], source[k]) for k in source)


def test_task_arithmetic_with_zero_lambda_is_the_base(trio, tmp_path):
    base, models = trio
    out = merged(tmp_path, f"kind: merge\nbase_model: {base}\nmodels: [{models[0]}, {models[1]}]\n"
                           "merge: {method: task_arithmetic, lambda: 0}\n")
    source = load_file(base / "model.safetensors")
    assert all(torch.equal(out[k], source[k]) for k in source)


def test_ties_with_role_override_matches_the_functions(trio, tmp_path):
    base, models = trio
    out = merged(tmp_path, f"kind: merge\nbase_model: {base}\n"
                           f"models: [{{model: {models[0]}, weight: 2}}, {models[1]}]\n"
                           "merge:\n  method: ties\n  density: 0.5\n  lambda: 0.8\n"
                           "  overrides: [{roles: [embed], method: average}]\n")
    tensors = [load_file(p / "model.safetensors") for p in (base, *models)]
    name = "model.layers.0.self_attn.q_proj.bias"
    expected = methods.ties(tensors[0][name], [t[name] for t in tensors[1:]],
                            weights=[2.0, 1.0], density=0.5, lam=0.8)
    torch.testing.assert_close(out[name], expected, atol=0, rtol=0)
    embed = "model.embed_tokens.weight"
    expected = methods.average([t[embed] for t in tensors[1:]], weights=[2.0, 1.0])
    torch.testing.assert_close(out[embed], expected, atol=0, rtol=0)


def test_slerp_gradient_over_the_layers(trio, tmp_path):
    # two layers: t = [0, 1] gives layer 0 the first model and layer 1 the second; tensors
    # outside the layers, the final norm and head too, take the gradient's first value (mergekit
    # 0.1's plan_module reads them all at t = 0; mergekit <= 0.0.6 read the final norm and
    # head at t = 1); the attn override holds t at 0.5 there
    base, models = trio
    out = merged(tmp_path, f"kind: merge\nmodels: [{models[0]}, {models[1]}]\n"
                           "merge:\n  method: slerp\n  t: [0, 1]\n"
                           "  overrides: [{roles: [attn], layers: [1], t: 0.5}]\n")
    first, second = (load_file(p / "model.safetensors") for p in models)
    for name in ("model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight",
                 "model.norm.weight", "lm_head.weight"):
        torch.testing.assert_close(out[name], first[name], atol=1e-6, rtol=0)
    torch.testing.assert_close(out["model.layers.1.mlp.up_proj.weight"],
                               second["model.layers.1.mlp.up_proj.weight"], atol=1e-6, rtol=0)
    name = "model.layers.1.self_attn.q_proj.weight"
    torch.testing.assert_close(out[name], sphere.slerp([first[name], second[name]], 0.5))


@pytest.mark.parametrize("method", ["breadcrumbs_ties", "della", "sce", "model_stock",
                                    "karcher", "multislerp"])
def test_new_methods_build_and_match_their_functions(method, trio, tmp_path):
    base, models = trio
    out = merged(tmp_path, f"kind: merge\nbase_model: {base}\nmodels: [{models[0]}, {models[1]}]\n"
                           f"seed: 3\nmerge: {{method: {method}}}\n")
    tensors = [load_file(p / "model.safetensors") for p in (base, *models)]
    name = "model.layers.1.self_attn.o_proj.weight"
    expected = merge(method, base=tensors[0][name], tensors=[t[name] for t in tensors[1:]],
                     draws=Draws.of(3, name))
    torch.testing.assert_close(out[name], expected, atol=0, rtol=0)


def test_passthrough_slices_stack_layers(trio, tmp_path):
    # 2-layer inputs: A's layers 0-1 then B's layer 1 make a 3-layer model that loads
    base, models = trio
    out = merged(tmp_path, "kind: merge\nslices:\n"
                           f"  - {{model: {models[0]}, layers: [0, 2]}}\n"
                           f"  - {{model: {models[1]}, layers: [1, 2]}}\n"
                           "merge: {method: passthrough}\n")
    a, b = (load_file(p / "model.safetensors") for p in models)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_hidden_layers"] == 3
    suffix = "self_attn.q_proj.weight"
    assert torch.equal(out[f"model.layers.1.{suffix}"], a[f"model.layers.1.{suffix}"])
    assert torch.equal(out[f"model.layers.2.{suffix}"], b[f"model.layers.1.{suffix}"])
    assert torch.equal(out["model.embed_tokens.weight"], a["model.embed_tokens.weight"])
    assert torch.equal(out["model.norm.weight"], b["model.norm.weight"])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert len(model.model.layers) == 3
    card = (tmp_path / "out" / "README.md").read_text()
    assert "2 slices of their layers stacked" in card and f"{models[1]} [1, 2]" in card


def test_slices_with_several_sources_merge_layer_by_layer(trio, tmp_path):
    # one slice, slerp of A's layers [0, 2) with B's; the gradient runs over the slice:
    # layer 0 at t 0 (A's), layer 1 at t 1 (B's); embeddings, final norm and head at t 0
    base, models = trio
    out = merged(tmp_path, "kind: merge\nslices:\n  - sources:\n"
                           f"      - {{model: {models[0]}, layers: [0, 2]}}\n"
                           f"      - {{model: {models[1]}, layers: [0, 2]}}\n"
                           "merge: {method: slerp, t: [0, 1]}\n")
    a, b = (load_file(p / "model.safetensors") for p in models)
    name = "model.layers.{}.mlp.down_proj.weight"
    torch.testing.assert_close(out[name.format(0)], a[name.format(0)], atol=1e-6, rtol=0)
    torch.testing.assert_close(out[name.format(1)], b[name.format(1)], atol=1e-6, rtol=0)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        torch.testing.assert_close(out[name], a[name], atol=1e-6, rtol=0)


def test_slices_past_the_last_layer_are_refused(trio, tmp_path):
    base, models = trio
    recipe = write_recipe(tmp_path / "r.yaml", "kind: merge\nslices:\n"
                          f"  - {{model: {models[0]}, layers: [0, 5]}}\n"
                          "merge: {method: passthrough}\n")
    with pytest.raises(MismatchError, match=r"has 2 layers; layers \[0, 5\] reach past them"):
        build(recipe, tmp_path / "out", progress=False)
