"""`import-mergekit` on configs of the methods mergekit 0.1.5 added after the classic ones:
nuslerp, nearswap, arcee_fusion, ram and ramplus_tl (their parameters, renamed where a
moemerge name means something else)."""

import pytest
import yaml

from moemerge.errors import RecipeError
from moemerge.recipe import parse_recipe
from moemerge.recipe.mergekit import convert, render

NUSLERP = """
models:
  - model: a/x
    parameters: {weight: 0.3}
  - model: b/y
    parameters: {weight: 0.7}
merge_method: nuslerp
base_model: base/model
parameters: {nuslerp_flatten: false, nuslerp_row_wise: true}
dtype: bfloat16
"""
NEARSWAP = """
models: [{model: base/model}, {model: a/x}]
merge_method: nearswap
base_model: base/model
parameters:
  t: [{filter: mlp, value: 0.001}, {value: 0.0001}]
"""
ARCEE_FUSION = """
models: [{model: base/model}, {model: a/x}]
merge_method: arcee_fusion
base_model: base/model
dtype: bfloat16
"""
RAM = """
models:
  - model: a/x
    parameters: {weight: 2}
  - model: b/y
merge_method: ram
base_model: base/model
parameters: {epsilon: 1.0e-4}
"""
RAMPLUS = """
models: [{model: a/x}, {model: b/y}, {model: c/z}]
merge_method: ramplus_tl
base_model: base/model
parameters: {epsilon: 1.0e-6, r: 0.2, alpha: 0.5}
"""


def imported(text):
    result = convert(yaml.safe_load(text), "config.yml")
    parse_recipe(yaml.safe_load(render(result, "config.yml")))  # what the user gets is valid
    return result


def test_nuslerp_carries_weights_flags_and_its_optional_base():
    r = imported(NUSLERP).recipe
    assert r["merge"] == {"method": "nuslerp", "nuslerp_flatten": False,
                          "nuslerp_row_wise": True}
    assert r["models"] == [{"model": "a/x", "weight": 0.3}, {"model": "b/y", "weight": 0.7}]
    assert r["base_model"] == {"model": "base/model"}
    no_base = imported(NUSLERP.replace("base_model: base/model\n", "")).recipe
    assert "base_model" not in no_base and len(no_base["models"]) == 2


def test_nearswap_t_becomes_swap_distance_with_its_filters():
    r = imported(NEARSWAP).recipe
    assert r["merge"] == {"method": "nearswap", "swap_distance": 0.0001,
                          "overrides": [{"tensors": ["mlp"], "swap_distance": 0.001}]}
    assert r["models"] == [{"model": "a/x"}]  # the base is the base, not a merged model
    assert r["base_model"] == {"model": "base/model"}


def test_arcee_fusion_merges_one_model_into_the_base():
    r = imported(ARCEE_FUSION).recipe
    assert (r["merge"], r["models"]) == ({"method": "arcee_fusion"}, [{"model": "a/x"}])


def test_ram_epsilon_becomes_nonzero_threshold_and_weights_are_dropped():
    result = imported(RAM)
    assert result.recipe["merge"] == {"method": "ram", "nonzero_threshold": 1e-4}
    assert result.recipe["models"] == [{"model": "a/x"}, {"model": "b/y"}]
    assert any("ram ignores a per-model weight" in n for n in result.notes)


def test_ramplus_tl_carries_r_alpha_and_epsilon():
    r = imported(RAMPLUS).recipe
    assert r["merge"] == {"method": "ramplus_tl", "nonzero_threshold": 1e-6, "r": 0.2,
                          "alpha": 0.5}


@pytest.mark.parametrize("text, message", [
    (NEARSWAP.replace("  t: [{filter: mlp, value: 0.001}, {value: 0.0001}]",
                      "  t: [{filter: mlp, value: 0.001}]"), "nearswap needs swap_distance"),
    (NEARSWAP.replace("[{model: base/model}, {model: a/x}]", "[{model: a/x}, {model: b/y}]"),
     "nearswap merges at most 1 models, got 2"),
    (NUSLERP.replace("  - model: b/y\n    parameters: {weight: 0.7}\n", ""),
     "nuslerp needs at least 2 models"),
])
def test_what_mergekit_refuses_is_refused(text, message):
    with pytest.raises(RecipeError) as info:
        imported(text)
    assert message in str(info.value), str(info.value)
