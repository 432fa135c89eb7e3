"""merged_experts plans from headers only: the output holds exactly the tensors of moemerge's
merged-experts class for the planned config; in every layer the reference FFN E_m, each
expert's FFN copied unchanged (Phi-3: its rows of gate_up_proj), a router, the curvature
factors; every other tensor merged across the experts by the recipe's method."""

import pytest
import torch

from moemerge.plan.jobs import Source
from plan.fakes import check_plan, fake, plan_from_headers, planned_shapes, saved_shapes

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3"]
PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def merged_experts(family: str, *, reference: bool = False, **extra):
    recipe = {"kind": "moe", "assembly": "merged_experts", "base_model": "base",
              "experts": ["e1", "e2", "e3"], "merge": {"method": "ties", "density": 0.7},
              "curvature": {"kind": "kronecker", "rank": 2}, **extra}
    names = ["base", "e1", "e2", "e3"]
    if reference:
        recipe["reference"] = {"model": "ref"}
        names.append("ref")
    return plan_from_headers(recipe, {n: fake(family) for n in names})


def ffn_source(family: str, layer: int, proj: str, model: int) -> Source:
    """Where projection `proj` of `layer` is read: its own tensor, or rows of Phi-3's fused
    gate_up_proj (intermediate_size 64: gate rows first)."""
    if family == "phi3" and proj != "down":
        rows = (0, 64) if proj == "gate" else (64, 128)
        return Source(model, f"model.layers.{layer}.mlp.gate_up_proj.weight", rows)
    return Source(model, f"model.layers.{layer}.mlp.{PROJ[proj]}.weight")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("extra", [{}, {"curvature": {"kind": "none"}}, {"dynamic": True}],
                         ids=["kronecker", "no_curvature", "dynamic"])
def test_the_plan_is_what_its_model_class_holds(family, extra):
    plan, models = merged_experts(family, **extra)
    check_plan(plan, models)
    assert plan.config["model_type"] == "moemerge_merged"
    assert planned_shapes(plan) == saved_shapes(plan.config)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("reference", [False, True], ids=["base_reference", "own_reference"])
def test_ffns_are_copied_from_their_expert_and_the_reference(family, reference):
    plan, models = merged_experts(family, reference=reference)
    assert plan.labels == ["base", *(["reference"] if reference else []), "e1", "e2", "e3"]
    experts = (2, 3, 4) if reference else (1, 2, 3)
    jobs = {job.output: job for job in plan.jobs}
    for layer in range(2):
        mlp = f"model.layers.{layer}.mlp"
        for proj, name in PROJ.items():
            job = jobs[f"{mlp}.reference.{name}.weight"]
            assert job.operation == "copy"
            assert job.sources == (ffn_source(family, layer, proj, 1 if reference else 0),)
            for i, m in enumerate(experts):
                job = jobs[f"{mlp}.experts.{i}.{name}.weight"]
                assert job.operation == "copy"
                assert job.sources == (ffn_source(family, layer, proj, m),)
            factors = [jobs[f"{mlp}.curvature.{name}.{f}"] for f in "ABCD"]
            assert all(j.operation == "identity" and j.dtype == torch.float32 for j in factors)
            assert all(j.shape[:2] == (3, 2) for j in factors)  # [experts, rank, d, d]
        router = jobs[f"{mlp}.router.weight"]
        assert router.operation == "random" and router.shape == (3, 32) and router.std > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_every_other_tensor_is_merged_across_the_experts(family):
    plan, models = merged_experts(family)
    jobs = {job.output: job for job in plan.jobs}
    for name, role in models[0].roles.items():
        if role.role == "ffn":
            continue
        job = jobs[name]
        merges = [p for g in job.parts for p in g] if job.operation == "fuse" else [job]
        if job.operation == "fuse":  # Phi-3's qkv_proj: q, k and v merged apart, then stacked
            assert family == "phi3" and [p.output.rsplit(":")[-1] for p in merges] == \
                ["q", "k", "v"]
        for part in merges:
            assert part.operation == "merge" and part.merge.method == "ties", name
            assert [(s.model, s.tensor) for s in part.sources] == [(m, name) for m in (1, 2, 3)]
            assert (part.base.model, part.base.tensor) == (0, name)
    if "lm_head.weight" not in models[0].reader:  # tied source: the head merged from embeddings
        head = jobs["lm_head.weight"]
        assert head.sources[0].tensor == "model.embed_tokens.weight" and head.role == "lm_head"


def test_dynamic_keeps_one_reference_ffn():
    plan, _ = merged_experts("qwen3", dynamic=True)
    references = sorted(j.output for j in plan.jobs if ".reference." in j.output)
    assert references == [f"model.layers.0.mlp.reference.{p}.weight"
                          for p in ("down_proj", "gate_proj", "up_proj")]

