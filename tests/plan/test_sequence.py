"""seq_routed and bridged plans from headers only: the output holds exactly the tensors of
moemerge's own model class for the planned config, every expert's decoder stack is copied
unchanged under experts.{i}., embeddings and head merged by the recipe (or kept per expert),
a sequence router, the base for task_vector routing; bridged experts of other widths and
families behind projectors."""

import pytest

from moemerge.errors import MismatchError
from moemerge.plan.jobs import Source
from plan.fakes import check_plan, fake, plan_from_headers, planned_shapes, saved_shapes

SEQUENCE_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3"]
HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"


def seq_routed(family: str, **extra):
    recipe = {"kind": "moe", "assembly": "seq_routed", "base_model": "base",
              "experts": [{"model": "e1", "name": "code"}, {"model": "e2", "name": "math"}],
              "merge": {"method": "task_arithmetic", "lambda": 0.5}, **extra}
    return plan_from_headers(recipe, {n: fake(family) for n in ("base", "e1", "e2")})


def head_of(models, m: int) -> str:
    """A tied source's head is its embedding."""
    return HEAD if HEAD in models[m].reader else EMBED


@pytest.mark.parametrize("family", SEQUENCE_FAMILIES)
@pytest.mark.parametrize("extra", [{}, {"per_expert": ["embed", "lm_head"]},
                                   {"router": {"kind": "task_vector"}, "experts_per_sequence": 2}],
                         ids=["merged", "per_expert", "task_vector"])
def test_seq_routed_is_what_its_model_class_holds(family, extra):
    plan, models = seq_routed(family, **extra)
    check_plan(plan, models)
    assert plan.config["model_type"] == "moemerge" and plan.config["assembly"] == "seq_routed"
    assert planned_shapes(plan) == saved_shapes(plan.config)


@pytest.mark.parametrize("family", SEQUENCE_FAMILIES)
def test_seq_routed_copies_each_stack_and_merges_embeddings_and_head(family):
    plan, models = seq_routed(family)
    jobs = {job.output: job for job in plan.jobs}
    for i, m in enumerate((1, 2)):  # expert i is model i + 1, every non-shared tensor copied
        stack = [n for n, r in models[m].roles.items() if r.role not in ("embed", "lm_head")]
        assert stack
        for name in stack:
            job = jobs[f"experts.{i}.{name}"]
            assert job.operation == "copy" and job.sources == (Source(m, name),), name
    for output, role in (("embed_tokens.weight", "embed"), ("lm_head.weight", "lm_head")):
        job = jobs[output]
        name = EMBED if role == "embed" else head_of(models, 1)
        assert job.operation == "merge" and job.merge.method == "task_arithmetic", output
        assert job.merge.params["lambda"] == 0.5
        assert job.sources == (Source(1, name), Source(2, name)) and job.base == Source(0, name)
    router = jobs["router.weight"]
    assert router.operation == "router" and router.shape == (2, 32)
    assert router.router_init == "random"
    assert not any(o.startswith("base.") for o in jobs)  # only task_vector routing keeps it


def test_per_expert_embeddings_and_heads_are_each_experts_own():
    plan, models = seq_routed("mistral", per_expert=["embed", "lm_head"])
    jobs = {job.output: job for job in plan.jobs}
    assert "embed_tokens.weight" not in jobs and "lm_head.weight" not in jobs
    for i, m in enumerate((1, 2)):
        assert jobs[f"experts.{i}.model.embed_tokens.weight"].sources == (Source(m, EMBED),)
        assert jobs[f"experts.{i}.lm_head.weight"].sources == (Source(m, HEAD),)


def test_task_vector_routing_keeps_the_whole_base():
    plan, models = seq_routed("llama", router={"kind": "task_vector"})  # tied: head = embedding
    base = {job.output: job for job in plan.jobs if job.output.startswith("base.")}
    assert set(base) == {f"base.{n}" for n in models[0].reader.names()} | {"base.lm_head.weight"}
    assert all(job.operation == "copy" and job.sources[0].model == 0 for job in base.values())
    assert base["base.lm_head.weight"].sources == (Source(0, EMBED),)


def test_a_prompts_router_reads_the_experts_embeddings():
    plan, _ = seq_routed("qwen3", router={"init": "prompts"},
                         experts=[{"model": "e1", "positive_prompts": ["def f():"]},
                                  {"model": "e2", "positive_prompts": ["2 + 2 = 4"]}])
    router = next(job for job in plan.jobs if job.output == "router.weight")
    assert router.router_init == "prompts"
    assert router.sources == (Source(1, EMBED), Source(2, EMBED))


# (families, mix): Gemma 2 softcaps its logits and Phi-3 does not, so they mix logits
BRIDGED = [(("llama", "qwen3"), "hidden"), (("gemma2", "phi3"), "logits"),
           (("mistral", "gemma3"), "hidden"), (("qwen2", "gemma"), "hidden")]


def bridged(families, widths=(32, 48), **extra):
    checkpoints = {f"e{i}": fake(f, hidden_size=w) for i, (f, w) in
                   enumerate(zip(families, widths, strict=True))}
    recipe = {"kind": "moe", "assembly": "bridged", "experts": list(checkpoints),
              "experts_per_sequence": 2, **extra}
    return plan_from_headers(recipe, checkpoints)


@pytest.mark.parametrize(("families", "mix"), BRIDGED, ids=lambda v: "-".join(v) if
                         isinstance(v, tuple) else v)
@pytest.mark.parametrize("projectors", [{}, {"init": "random", "hidden_size": 8},
                                        {"init": "identity"}], ids=["lstsq", "mlp", "identity"])
def test_bridged_is_what_its_model_class_holds(families, mix, projectors):
    plan, models = bridged(families, projectors=projectors, mix=mix)
    check_plan(plan, models)
    assert plan.config["assembly"] == "bridged" and plan.config["hidden_size"] == 48
    assert planned_shapes(plan) == saved_shapes(plan.config)


def test_bridged_pads_and_averages_the_shared_tensors_and_fits_projectors():
    plan, models = bridged(("llama", "qwen3"), widths=(32, 48))
    jobs = {job.output: job for job in plan.jobs}
    embed = jobs["embed_tokens.weight"]  # each expert's, zero-padded to 48 and averaged
    assert embed.operation == "merge" and embed.merge.method == "average"
    assert embed.shape == (300, 48)
    assert embed.sources == (Source(0, EMBED), Source(1, EMBED))
    for i, width in enumerate((32, 48)):
        proj_in, proj_out = jobs[f"experts.{i}.proj_in.linear.weight"], \
            jobs[f"experts.{i}.proj_out.linear.weight"]
        assert (proj_in.shape, proj_out.shape) == ((width, 48), (48, width))
        assert proj_in.operation == proj_out.operation == "lstsq"  # two experts: auto is lstsq
        assert proj_in.base == Source(i, EMBED) and proj_in.sources == embed.sources
        assert proj_out.base == Source(i, HEAD if HEAD in models[i].reader else EMBED)
        for name in models[i].reader.names():
            if models[i].roles[name].role not in ("embed", "lm_head"):
                assert jobs[f"experts.{i}.{name}"].sources == (Source(i, name),)


@pytest.mark.parametrize("assembly", ["seq_routed", "bridged", "merged_experts"])
@pytest.mark.parametrize("family", ["olmo2", "granite"])
def test_kinds_with_shipped_code_refuse_post_norm_and_multiplier_families(assembly, family):
    base = {"base_model": "base"} if assembly != "bridged" else {}
    recipe = {"kind": "moe", "assembly": assembly, **base, "experts": ["e1", "e2"]}
    with pytest.raises(MismatchError, match=f"builds into assembly token_routed only, not "
                                            f"{assembly}"):
        plan_from_headers(recipe, {n: fake(family) for n in ("base", "e1", "e2")})
