"""Per-model parameters from recipe to job: a model's own value (a number, a gradient over the
layers, conditions selecting tensors), else the merge block's (its overrides, then its
top-level value), else the default; each model's weight likewise; the tuner varies the merge
block's value and leaves a model's own. Checked on the plans of fake 3-layer Llama checkpoints,
and on the merged values of tiny tensors."""

import pytest
import torch

from moemerge.errors import RecipeError
from moemerge.execute import compute
from moemerge.plan.jobs import Source
from moemerge.recipe.load import load_recipe
from plan.fakes import fake, plan_from_headers

O_PROJ, DOWN, UP = (f"model.layers.{{}}.{n}.weight" for n in (
    "self_attn.o_proj", "mlp.down_proj", "mlp.up_proj"))
EMBED = "model.embed_tokens.weight"

# mergekit's examples/ties.yml, in moemerge's terms (tests/data/mergekit/ties.yml)
TIES_YML = [
    {"model": "x", "density": [1, 0.7, 0.1], "weight": 1.0},
    {"model": "y", "density": 0.5, "weight": [0, 0.3, 0.7, 1]},
    {"model": "z", "density": 0.33, "weight": [{"tensors": ["mlp"], "value": 0.5},
                                               {"value": 0}]},
]


def jobs_of(models, merge, names=("base", "x", "y", "z")):
    recipe = {"kind": "merge", "base_model": "base", "models": models, "merge": merge}
    plan, _ = plan_from_headers(recipe, {n: fake("llama", num_hidden_layers=3) for n in names})
    return {job.output: job for job in plan.jobs}


def test_the_ties_example_resolves_per_model_per_layer_and_per_filter():
    jobs = jobs_of(TIES_YML, {"method": "ties"})
    # layer 1 of 3 is halfway: x's density gradient gives 0.7, y's weight gradient 0.5
    mid = jobs[DOWN.format(1)]
    assert mid.merge.get("density") == (0.7, 0.5, 0.33)
    assert mid.weights == pytest.approx((1.0, 0.5, 0.5))  # z: its `mlp` condition
    assert jobs[O_PROJ.format(1)].weights == pytest.approx((1.0, 0.5, 0.0))  # z: no filter
    last = jobs[O_PROJ.format(2)]
    assert last.merge.get("density") == pytest.approx((0.1, 0.5, 0.33))
    assert last.weights == (1.0, 1.0, 0.0)
    # tensors outside the layers take a gradient's first value (mergekit)
    assert jobs[EMBED].merge.get("density") == (1.0, 0.5, 0.33)
    assert jobs[EMBED].weights == (1.0, 0.0, 0.0)


def test_a_models_own_value_wins_then_the_filter_then_the_global_then_the_default():
    models = [{"model": "x", "density": [{"tensors": ["down_proj"], "value": 0.2}]}, "y"]
    merge = {"method": "ties", "density": 0.6,
             "overrides": [{"tensors": ["mlp"], "density": 0.4}]}
    jobs = jobs_of(models, merge, ("base", "x", "y"))
    assert jobs[DOWN.format(0)].merge.get("density") == (0.2, 0.4)  # own, then filtered
    assert jobs[UP.format(0)].merge.get("density") == 0.4  # x's condition misses: falls through
    assert jobs[O_PROJ.format(0)].merge.get("density") == 0.6  # global
    assert jobs_of(models, {"method": "ties"}, ("base", "x", "y"))[O_PROJ.format(0)].merge.get(
        "density") == 0.7  # the registry's default
    # lambda is one value for all models: its filter and its gradient, else the global
    merge = {"method": "ties", "lambda": [0.0, 1.0],
             "overrides": [{"tensors": ["o_proj"], "lambda": 0.3}]}
    jobs = jobs_of(models, merge, ("base", "x", "y"))
    assert [jobs[DOWN.format(i)].merge.get("lambda") for i in range(3)] == [0.0, 0.5, 1.0]
    assert jobs[O_PROJ.format(1)].merge.get("lambda") == 0.3


def test_tuning_varies_the_merge_blocks_value_and_keeps_a_models_own():
    models = [{"model": "x", "density": 0.2}, "y"]
    job = jobs_of(models, {"method": "ties", "density": 0.6}, ("base", "x", "y"))[DOWN.format(0)]
    assert job.merge.with_values(density=0.9, **{"lambda": 0.5}).params["density"] == (0.2, 0.9)
    assert job.merge.with_values(**{"lambda": 0.5}).params["lambda"] == 0.5


def test_a_per_model_value_changes_the_merged_tensor():
    def load(source: Source) -> torch.Tensor:  # tiny distinct tensors per model
        g = torch.Generator().manual_seed(source.model * 7919 + len(source.tensor))
        return torch.randn(32, 32, generator=g)

    own = jobs_of([{"model": "x", "density": 0.2}, "y"], {"method": "ties", "density": 0.6},
                  ("base", "x", "y"))[O_PROJ.format(0)]
    shared = jobs_of(["x", "y"], {"method": "ties", "density": 0.6},
                     ("base", "x", "y"))[O_PROJ.format(0)]
    assert not torch.equal(compute(own, load, None, 0), compute(shared, load, None, 0))


def test_signed_weights_reach_the_job():
    jobs = jobs_of([{"model": "x", "weight": 1.0}, {"model": "y", "weight": -0.5}],
                   {"method": "task_arithmetic", "normalize": False}, ("base", "x", "y"))
    assert jobs[O_PROJ.format(0)].weights == (1.0, -0.5)


def test_passthrough_scale_per_source_silences_a_slice_tensor():
    recipe = {"kind": "merge", "merge": {"method": "passthrough"}, "slices": [
        {"sources": [{"model": "x", "layers": [0, 3]}]},
        {"sources": [{"model": "x", "layers": [1, 3], "scale": [{"tensors": ["o_proj"],
                                                                   "value": 0.0}]}]}]}
    plan, _ = plan_from_headers(recipe, {"x": fake("llama", num_hidden_layers=3)})
    jobs = {job.output: job for job in plan.jobs}
    assert jobs[O_PROJ.format(1)].operation == "copy"  # first slice: no scale
    assert jobs[O_PROJ.format(3)].operation == "merge"
    assert jobs[O_PROJ.format(3)].merge.get("scale") == (0.0,)
    assert jobs[DOWN.format(3)].operation == "copy"  # the condition selects o_proj only


@pytest.mark.parametrize("models, merge, message", [
    ([{"model": "x", "density": 0.5}, "y"], {"method": "average"},
     "models.0.density: not read per model by average"),
    ([{"model": "x", "weight": -0.5}, "y"], {"method": "ties"},
     "models.0.weight: -0.5 is negative; ties cannot take a negative weight"),
    ([{"model": "x", "weight": [{"value": -1}]}, "y"],
     {"method": "task_arithmetic", "overrides": [{"roles": ["norm"], "method": "dare_ties"}]},
     "models.0.weight: -1 is negative; dare_ties cannot"),
    ([{"model": "x", "lambda": 0.5}, "y"], {"method": "ties"},
     "lambda: not a per-model parameter"),
    ([{"model": "x", "density": [{"tensors": ["mlp"], "value": 1.5}]}, "y"], {"method": "ties"},
     r"models.0.density: must be in \(0, 1\], got 1.5"),
    ([{"model": "x", "weight": True}, "y"], {"method": "ties"}, "models.0.weight: must be a "
     "number"),
    ([{"model": "x", "density": {"value": []}}, "y"], {"method": "ties"},
     "a per-layer gradient needs at least one value"),
])
def test_refused_naming_the_file_and_the_field(tmp_path, models, merge, message):
    import yaml
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"kind": "merge", "base_model": "b", "models": models,
                                    "merge": merge}))
    with pytest.raises(RecipeError, match=message) as err:
        load_recipe(path)
    assert str(path) in str(err.value)


def test_della_checks_each_models_own_density_and_epsilon():
    from moemerge.merge.registry import REGISTRY
    della = REGISTRY["della"]
    assert della.problem({"density": (0.5, 0.9), "epsilon": 0.05}) is None
    assert "density 0.9, epsilon 0.15" in della.problem({"density": (0.5, 0.9)})
