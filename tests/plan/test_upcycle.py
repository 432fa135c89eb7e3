"""upcycle plans from headers only: the output holds exactly what transformers' MoE class for
the planned config saves; non-FFN tensors copied from the dense model, a router per layer,
expert c·m + j = slice j of copy c of the dense FFN (a copy of the dense tensor with an
UpcycledSlice change, made in the execute loop: the plan names which tensor, copy and slice)."""

import pytest
from conftest import needs_class

from moemerge.errors import MismatchError, RecipeError
from moemerge.plan.jobs import Source
from moemerge.plan.upcycle import UpcycledSlice
from plan.fakes import check_plan, fake, plan_from_headers, planned_shapes, saved_shapes

TARGETS = {"llama": "MixtralForCausalLM", "mistral": "MixtralForCausalLM",
           "qwen2": "Qwen2MoeForCausalLM", "qwen3": "Qwen3MoeForCausalLM",
           "olmo2": "FlexOlmoForCausalLM", "granite": "GraniteMoeForCausalLM"}
CASES = [pytest.param(family, m, marks=needs_class(arch), id=f"{family}-m{m}")
         for family, arch in TARGETS.items() for m in (1, 2, 4)]


def upcycle(family: str, granularity: int = 1, **extra):
    recipe = {"kind": "upcycle", "model": "dense", "experts": 3, "granularity": granularity,
              "experts_per_token": 2, **extra}
    return plan_from_headers(recipe, {"dense": fake(family)})


@pytest.mark.parametrize(("family", "m"), CASES)
def test_the_plan_is_what_transformers_saves(family, m):
    plan, models = upcycle(family, m)
    check_plan(plan, models)
    assert plan.labels == ["dense"]
    assert plan.config["architectures"] == [TARGETS[family]]
    assert planned_shapes(plan) == saved_shapes(plan.config)
    experts = plan.config.get("num_local_experts", plan.config.get("num_experts"))
    assert experts == 3 * m and plan.config["num_experts_per_tok"] == 2 * m


@pytest.mark.parametrize(("family", "m"), CASES)
def test_experts_are_slices_of_copies_of_the_dense_ffn(family, m):
    plan, models = upcycle(family, m)
    dense = models[0]
    copies = [s for job in plan.jobs for g in (job.parts or ((job,),)) for p in g
              for s in p.inputs if s.change is not None]
    assert all(isinstance(s.change, UpcycledSlice) and s.model == 0 for s in copies)
    # each dense FFN tensor of each layer: 3 copies × m slices, in that order, each made once
    for name, role in dense.roles.items():
        if role.role == "ffn":
            made = [(s.change.copy, s.change.slice) for s in copies if s.tensor == name]
            assert made == [(c, j) for c in range(3) for j in range(m)]
            assert all(s.change.dense == name and s.change.proj == role.proj
                       for s in copies if s.tensor == name)
    assert len(copies) == len(set(copies)) == 3 * m * sum(
        r.role == "ffn" for r in dense.roles.values())
    width = 64 // m  # intermediate_size / m: gate/up keep rows, down keeps columns
    for job in plan.jobs:
        for part in (p for g in (job.parts or ((job,),)) for p in g):
            if part.sources and part.sources[0].change is not None:
                assert tuple(part.shape) == ((32, width) if ".down_proj" in part.sources[0].tensor
                                             else (width, 32))
    assert plan.config.get("moe_intermediate_size", plan.config["intermediate_size"]) == width


@pytest.mark.parametrize("family", list(TARGETS))
def test_everything_else_is_the_dense_models_and_routers_are_made(family):
    plan, models = upcycle(family, 2, router={"init": "virtual_group"})
    for job in plan.jobs:
        if job.operation == "router":
            assert job.shape == (6, 32) and job.router_init == "virtual_group" and not job.inputs
        elif job.role not in ("ffn", "router"):
            assert job.operation == "copy" and job.sources == (Source(0, job.output),), job.output
    assert sum(job.operation == "router" for job in plan.jobs) == 2
    if family == "qwen2":  # Qwen2-MoE's shared expert is zeroed: it adds nothing
        shared = [j for j in plan.jobs if ".shared_expert." in j.output]
        assert len(shared) == 6 and all(j.operation == "zeros" for j in shared)


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3", "phi3"])
def test_families_no_moe_class_computes_are_refused(family):
    with pytest.raises(MismatchError, match="cannot become a token_routed or upcycled MoE"):
        upcycle(family)


def test_a_granularity_that_does_not_divide_the_width_is_refused():
    with pytest.raises(RecipeError, match="granularity: 3 does not divide .* 64"):
        upcycle("llama", 3)
