"""token_routed plans from headers only, for every output layout of architectures/moe.yaml:
the output holds exactly the tensors transformers' class of the planned config saves, each
expert's FFN is copied unchanged from its own expert, a router per layer, the shared expert as
the recipe asks, every other tensor merged across the experts by the recipe's method."""

import pytest
from conftest import needs_class

from moemerge.errors import MismatchError, RecipeError
from moemerge.plan.jobs import Source
from plan.fakes import check_plan, fake, plan_from_headers, planned_shapes, saved_shapes

LAYOUTS = [  # (source family, recipe's shared_expert, output class)
    ("llama", "none", "MixtralForCausalLM"),
    ("mistral", "none", "MixtralForCausalLM"),
    ("llama", "base", "DeepseekForCausalLM"),
    ("mistral", "average", "DeepseekForCausalLM"),
    ("qwen2", "none", "Qwen2MoeForCausalLM"),
    ("qwen2", "base", "Qwen2MoeForCausalLM"),
    ("qwen2", "average", "Qwen2MoeForCausalLM"),
    ("qwen3", "none", "Qwen3MoeForCausalLM"),
    ("olmo2", "none", "FlexOlmoForCausalLM"),
    ("granite", "none", "GraniteMoeForCausalLM"),
    ("granite", "base", "GraniteMoeSharedForCausalLM"),
    ("granite", "average", "GraniteMoeSharedForCausalLM"),
]
SHIPPED = {"DeepseekForCausalLM"}  # moemerge's own modeling code, not transformers'
CASES = [pytest.param(*case, marks=() if case[2] in SHIPPED else needs_class(case[2]),
                      id=f"{case[0]}-{case[1]}") for case in LAYOUTS]
# the routed experts' tensors as written: (pattern of {layer} {expert}, projection names) or,
# for GraniteMoE's fused experts, {fused tensor: projections, each expert's rows stacked}
EXPERTS = {
    "MixtralForCausalLM": ("model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
                           {"gate": "w1", "up": "w3", "down": "w2"}),
    "Qwen2MoeForCausalLM": ("model.layers.{layer}.mlp.experts.{expert}.{proj}.weight", None),
    "Qwen3MoeForCausalLM": ("model.layers.{layer}.mlp.experts.{expert}.{proj}.weight", None),
    "FlexOlmoForCausalLM": ("model.layers.{layer}.mlp.experts.{expert}.{proj}.weight", None),
    "DeepseekForCausalLM": ("model.layers.{layer}.mlp.experts.{expert}.{proj}.weight", None),
    "GraniteMoeForCausalLM": {"model.layers.{layer}.block_sparse_moe.input_linear.weight":
                              ("gate", "up"),
                              "model.layers.{layer}.block_sparse_moe.output_linear.weight":
                              ("down",)},
}
EXPERTS["GraniteMoeSharedForCausalLM"] = EXPERTS["GraniteMoeForCausalLM"]
ROUTER = {"MixtralForCausalLM": "model.layers.{layer}.block_sparse_moe.gate.weight",
          "GraniteMoeForCausalLM": "model.layers.{layer}.block_sparse_moe.router.layer.weight",
          "GraniteMoeSharedForCausalLM":
              "model.layers.{layer}.block_sparse_moe.router.layer.weight"}
WEIGHTS = (1.0, 3.0, 2.0)


def recipe(shared: str = "none", **extra) -> dict:
    return {"kind": "moe", "assembly": "token_routed", "base_model": "base",
            "experts": [{"model": f"e{i}", "weight": w} for i, w in enumerate(WEIGHTS, 1)],
            "experts_per_token": 2, "shared_expert": shared,
            "merge": {"method": "ties", "density": 0.5}, "router": {"init": "task_vector"},
            **extra}


def planned(family: str, shared: str = "none", **extra):
    checkpoints = {name: fake(family) for name in ("base", "e1", "e2", "e3")}
    return plan_from_headers(recipe(shared, **extra), checkpoints)


def dense_ffn(layer: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.{proj}_proj.weight"


def expert_reads(plan, architecture: str, layer: int, expert: int) -> dict[str, Source]:
    """{projection: the one tensor} that routed expert `expert` of `layer` is copied from."""
    jobs = {job.output: job for job in plan.jobs}
    spec = EXPERTS[architecture]
    found = {}
    if isinstance(spec, tuple):
        pattern, names = spec
        for proj in ("gate", "up", "down"):
            on_disk = names[proj] if names else f"{proj}_proj"
            job = jobs[pattern.format(layer=layer, expert=expert, proj=on_disk)]
            assert job.operation == "copy" and len(job.sources) == 1
            found[proj] = job.sources[0]
        return found
    for pattern, projs in spec.items():
        job = jobs[pattern.format(layer=layer)]
        assert job.operation == "fuse" and len(job.shape) == 3  # [experts, rows, cols]
        for proj, part in zip(projs, job.parts[expert], strict=True):
            assert part.operation == "copy" and len(part.sources) == 1
            found[proj] = part.sources[0]
    return found


@pytest.mark.parametrize(("family", "shared", "architecture"), CASES)
def test_the_plan_is_what_transformers_saves(family, shared, architecture):
    plan, models = planned(family, shared)
    check_plan(plan, models)
    assert plan.config["architectures"] == [architecture]
    assert planned_shapes(plan) == saved_shapes(plan.config)


@pytest.mark.parametrize(("family", "shared", "architecture"), CASES)
def test_each_expert_is_its_own_ffn_copied(family, shared, architecture):
    plan, models = planned(family, shared)
    assert plan.labels == ["base", "e1", "e2", "e3"]
    for layer in range(2):
        for expert in range(3):  # expert i is the (i+1)-th model, the base's FFN in none
            assert expert_reads(plan, architecture, layer, expert) == {
                proj: Source(expert + 1, dense_ffn(layer, proj)) for proj in ("gate", "up", "down")}


def test_include_base_expert_adds_the_base_ffn_last():
    plan, _ = planned("llama", include_base_expert=True)
    assert plan.config["num_local_experts"] == 4
    for layer in range(2):
        assert expert_reads(plan, "MixtralForCausalLM", layer, 3) == {
            proj: Source(0, dense_ffn(layer, proj)) for proj in ("gate", "up", "down")}


@pytest.mark.parametrize(("family", "shared", "architecture"), CASES)
def test_a_router_per_layer_from_the_experts_gates(family, shared, architecture):
    plan, _ = planned(family, shared)
    routers = [job for job in plan.jobs if job.operation == "router"]
    pattern = ROUTER.get(architecture, "model.layers.{layer}.mlp.gate.weight")
    assert [job.output for job in routers] == [pattern.format(layer=layer) for layer in range(2)]
    for layer, job in enumerate(routers):
        assert job.shape == (3, 32) and job.router_init == "task_vector" and job.layer == layer
        # task_vector routers read each expert's gate projection against the base's
        assert job.sources == tuple(Source(m, dense_ffn(layer, "gate")) for m in (1, 2, 3))
        assert job.base == Source(0, dense_ffn(layer, "gate"))


def test_routers_of_other_inits_read_nothing():
    plan, _ = planned("qwen3", router={"init": "random"})
    routers = [job for job in plan.jobs if job.operation == "router"]
    assert len(routers) == 2 and all(not j.inputs and j.router_init == "random" for j in routers)


@pytest.mark.parametrize(("family", "shared", "architecture"), CASES)
def test_every_other_tensor_is_merged_across_the_experts(family, shared, architecture):
    plan, models = planned(family, shared)
    jobs = {job.output: job for job in plan.jobs}
    others = [n for n, r in models[0].roles.items() if r.role != "ffn"]
    assert others
    for name in others:
        job = jobs[name]
        assert job.operation == "merge" and job.merge.method == "ties", name
        assert job.sources == tuple(Source(m, name) for m in (1, 2, 3))
        assert job.base == Source(0, name) and job.weights == WEIGHTS
        assert job.merge.params["density"] == 0.5


def test_the_shared_expert_is_what_the_recipe_asks():
    def shared_jobs(family, shared):
        plan, _ = planned(family, shared)
        return {j.output.split(".mlp.", 1)[-1]: j for j in plan.jobs
                if j.layer == 1 and ".shared_" in j.output}

    none = shared_jobs("qwen2", "none")  # width 1, zeros: it adds nothing
    assert {k: (j.operation, j.shape) for k, j in none.items()
            if k != "shared_expert_gate.weight"} \
        == {f"shared_expert.{p}_proj.weight": ("zeros", (32, 1) if p == "down" else (1, 32))
            for p in ("gate", "up", "down")}
    for shared in ("none", "base", "average"):  # a random gate, never all zeros (llama.cpp)
        gate = shared_jobs("qwen2", shared)["shared_expert_gate.weight"]
        assert gate.operation == "random" and gate.shape == (1, 32) and gate.std > 0
    base = shared_jobs("qwen2", "base")
    for proj in ("gate", "up", "down"):
        job = base[f"shared_expert.{proj}_proj.weight"]
        assert job.operation == "copy" and job.sources == (Source(0, dense_ffn(1, proj)),)
        job = shared_jobs("qwen2", "average")[f"shared_expert.{proj}_proj.weight"]
        assert job.operation == "merge" and job.merge.method == "average" and job.base is None
        assert job.sources == tuple(Source(m, dense_ffn(1, proj)) for m in (1, 2, 3))
        assert job.weights == WEIGHTS
    plan, _ = planned("granite", "base")  # GraniteMoeShared: one fused MLP, no gate
    fused = {j.output: j for j in plan.jobs if ".shared_mlp." in j.output and j.layer == 1}
    assert sorted(fused) == ["model.layers.1.shared_mlp.input_linear.weight",
                             "model.layers.1.shared_mlp.output_linear.weight"]
    (gate, up), = fused["model.layers.1.shared_mlp.input_linear.weight"].parts
    assert (gate.sources, up.sources) == ((Source(0, dense_ffn(1, "gate")),),
                                          (Source(0, dense_ffn(1, "up")),))
    assert plan.config["shared_intermediate_size"] == 64


def test_the_config_counts_the_experts_and_keeps_the_source_keys():
    plan, models = planned("granite", "none")
    config, source = plan.config, models[0].config
    assert config["num_local_experts"] == 3 and config["num_experts_per_tok"] == 2
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                "logits_scaling", "hidden_size", "vocab_size", "tie_word_embeddings"):
        assert config[key] == source[key], key
    plan, _ = planned("qwen2", "none")
    assert plan.config["shared_expert_intermediate_size"] == 1
    assert plan.config["moe_intermediate_size"] == 64


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3", "phi3"])
def test_families_no_moe_class_computes_are_refused(family):
    with pytest.raises(MismatchError, match="no transformers MoE class computes"):
        planned(family)


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_a_shared_expert_needs_a_layout_that_has_one(family):
    with pytest.raises(RecipeError, match="shared_expert: 'base' needs an output layout"):
        planned(family, "base")


def test_a_shared_expert_from_a_model_reads_the_last_model():
    checkpoints = {name: fake("llama") for name in ("base", "e1", "e2", "e3", "s")}
    for layout, gate in (("deepseek", None), ("qwen2_moe", "random")):
        plan, models = plan_from_headers(recipe({"model": "s"}, layout=layout), checkpoints)
        check_plan(plan, models)
        assert plan.labels == ["base", "e1", "e2", "e3", "s"]
        assert planned_shapes(plan) == saved_shapes(plan.config)
        jobs = {j.output: j for j in plan.jobs if j.layer == 1 and ".shared_expert" in j.output}
        for proj in ("gate", "up", "down"):
            job = next(j for n, j in jobs.items() if n.endswith(f".{proj}_proj.weight"))
            assert job.operation == "copy" and job.sources == (Source(4, dense_ffn(1, proj)),)
        gates = [j.operation for n, j in jobs.items() if n.endswith("shared_expert_gate.weight")]
        assert gates == ([gate] if gate else [])
        routers = [j for j in plan.jobs if j.operation == "router"]
        assert all(s.model in (1, 2, 3) for j in routers for s in j.sources)  # not the shared


def test_deepseek_without_a_shared_expert_and_qwen2_moe_from_llama():
    plan, models = planned("llama", layout="deepseek")
    check_plan(plan, models)
    assert plan.config["n_shared_experts"] is None and plan.config["moe_intermediate_size"] == 64
    assert not [j for j in plan.jobs if "shared" in j.output]
    assert planned_shapes(plan) == saved_shapes(plan.config)
    plan, models = planned("llama", layout="qwen2_moe")
    assert planned_shapes(plan) == saved_shapes(plan.config)
    biases = [j for j in plan.jobs if j.output.endswith(".bias")]
    assert len(biases) == 6 and all(j.operation == "zeros" for j in biases)  # q, k, v × 2 layers
    assert {j.shape for j in biases} == {(32,), (16,)}  # q: 4 heads × 8; k, v: 2 × 8



def test_tensors_the_family_does_not_list_are_refused():
    """A Llama with attention biases: no table row says what they are (dense.yaml)."""
    checkpoints = {name: fake("llama", attention_bias=True) for name in ("base", "e1", "e2", "e3")}
    assert "model.layers.0.self_attn.q_proj.bias" in checkpoints["base"]
    with pytest.raises(MismatchError, match=r"tensor 'model.layers.0.self_attn.\w_proj.bias' in "
                                            r"base \(.*\) is not a known llama-family tensor"):
        plan_from_headers(recipe(), checkpoints)
