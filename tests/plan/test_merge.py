"""Dense merges from headers only, every family: the output holds exactly what the family's
transformers class saves; every tensor merged from the same tensor of every model by the
recipe's method (Phi-3's fused tensors part by part); `slices` stack layer ranges and the
config follows the new depth. Models that do not line up are refused, naming the tensor and
the models."""

import pytest

from moemerge.errors import CheckpointError, MismatchError
from moemerge.plan.jobs import Source
from plan.fakes import FAMILIES, check_plan, fake, plan_from_headers, planned_shapes, saved_shapes

LAYER = "model.layers.{}.self_attn.o_proj.weight"


def merge(family: str, **extra):
    recipe = {"kind": "merge", "base_model": "base", "models": ["a", "b"],
              "merge": {"method": "ties", "density": 0.5}, **extra}
    return plan_from_headers(recipe, {n: fake(family) for n in ("base", "a", "b")})


@pytest.mark.parametrize("family", FAMILIES)
def test_a_merge_is_what_the_family_saves_and_merges_every_tensor(family):
    plan, models = merge(family)
    check_plan(plan, models)
    assert planned_shapes(plan) == saved_shapes(plan.config) == saved_shapes(models[0].config)
    assert plan.config["model_type"] == models[0].config["model_type"]
    for job in plan.jobs:
        parts = [p for g in job.parts for p in g] if job.operation == "fuse" else [job]
        assert family == "phi3" or job.operation == "merge"
        for part in parts:
            assert part.operation == "merge" and part.merge.method == "ties"
            assert [s.model for s in part.sources] == [1, 2] and part.base.model == 0
            assert {s.tensor for s in (*part.sources, part.base)} == {job.output}


def test_phi3_fused_tensors_are_merged_part_by_part():
    plan, _ = merge("phi3")
    jobs = {job.output: job for job in plan.jobs}
    qkv = jobs["model.layers.0.self_attn.qkv_proj.weight"]  # q 32 rows, k and v 16 each
    assert qkv.operation == "fuse" and qkv.shape == (64, 32)
    assert [(p.output.rsplit(":")[-1], p.sources[0].rows) for p in qkv.parts[0]] == \
        [("q", (0, 32)), ("k", (32, 48)), ("v", (48, 64))]
    gate_up = jobs["model.layers.1.mlp.gate_up_proj.weight"]
    assert [p.sources[1].rows for p in gate_up.parts[0]] == [(0, 64), (64, 128)]


@pytest.mark.parametrize("family", FAMILIES)
def test_slices_stack_layers_and_the_config_follows(family):
    recipe = {"kind": "merge", "merge": {"method": "passthrough"}, "slices": [
        {"sources": [{"model": "a", "layers": [0, 2]}]},
        {"sources": [{"model": "b", "layers": [1, 2]}]}]}
    plan, models = plan_from_headers(recipe, {"a": fake(family), "b": fake(family)})
    check_plan(plan, models)
    assert plan.config["num_hidden_layers"] == 3
    assert planned_shapes(plan) == saved_shapes(plan.config)
    jobs = {job.output: job for job in plan.jobs}
    assert [jobs[LAYER.format(i)].sources for i in range(3)] == [
        (Source(0, LAYER.format(0)),), (Source(0, LAYER.format(1)),), (Source(1, LAYER.format(1)),)]
    assert jobs["model.embed_tokens.weight"].sources[0].model == 0  # the first slice's
    assert jobs["model.norm.weight"].sources[0].model == 1  # the last slice's
    if "layer_types" in plan.config:  # per-layer lists re-cut to the stack
        assert len(plan.config["layer_types"]) == 3


def test_slices_merged_layer_by_layer():
    recipe = {"kind": "merge", "merge": {"method": "slerp", "t": 0.3}, "slices": [
        {"sources": [{"model": "a", "layers": [0, 2]}, {"model": "b", "layers": [0, 2]}]}]}
    plan, _ = plan_from_headers(recipe, {"a": fake("qwen3"), "b": fake("qwen3")})
    job = next(j for j in plan.jobs if j.output == LAYER.format(1))
    assert job.operation == "merge" and job.merge.method == "slerp"
    assert job.sources == (Source(0, LAYER.format(1)), Source(1, LAYER.format(1)))


def test_slices_past_a_models_depth_are_refused():
    recipe = {"kind": "merge", "merge": {"method": "passthrough"},
              "slices": [{"sources": [{"model": "a", "layers": [0, 5]}]}]}
    with pytest.raises(MismatchError, match=r"has 2 layers; layers \[0, 5\] reach past them"):
        plan_from_headers(recipe, {"a": fake("llama")})


NORM = "model.layers.1.input_layernorm.weight"


@pytest.mark.parametrize("recipe", [
    {"kind": "merge", "base_model": "base", "models": ["a", "b"]},
    {"kind": "moe", "base_model": "base", "experts": ["a", "b"]},
    {"kind": "moe", "assembly": "seq_routed", "base_model": "base", "experts": ["a", "b"]},
    {"kind": "moe", "assembly": "merged_experts", "base_model": "base", "experts": ["a", "b"]},
], ids=["merge", "token_routed", "seq_routed", "merged_experts"])
def test_a_tensor_whose_shape_differs_is_refused_naming_it_and_the_models(recipe):
    checkpoints = {"base": fake("llama"), "a": fake("llama"),
                   "b": fake("llama", changed={NORM: (33,)})}
    with pytest.raises(MismatchError, match=rf"shape mismatch for tensor '{NORM}': \[32\] in "
                                            r"base \(.*/base\) but \[33\] in b \(.*/b\)"):
        plan_from_headers(recipe, checkpoints)


def test_a_tensor_that_disagrees_with_its_config_is_refused():
    down = "model.layers.0.mlp.down_proj.weight"
    checkpoints = {"base": fake("qwen2"), "a": fake("qwen2", changed={down: (32, 65)})}
    with pytest.raises(CheckpointError, match=rf"a: .*/a: tensor '{down}' is \[32, 65\] but "
                                              r"config.json's shape fields make it \[32, 64\]"):
        plan_from_headers({"kind": "merge", "base_model": "base", "models": ["a"]}, checkpoints)


def test_other_families_or_widths_are_refused():
    with pytest.raises(MismatchError, match="architecture mismatch: base .* is llama but a .* "
                                            "is qwen3"):
        plan_from_headers({"kind": "merge", "base_model": "base", "models": ["a"]},
                          {"base": fake("llama"), "a": fake("qwen3", head_dim=8)})
    with pytest.raises(MismatchError, match="config mismatch: intermediate_size is 64 in base"):
        plan_from_headers({"kind": "moe", "base_model": "base", "experts": ["a"],
                           "experts_per_token": 1},
                          {"base": fake("llama"), "a": fake("llama", intermediate_size=96)})
