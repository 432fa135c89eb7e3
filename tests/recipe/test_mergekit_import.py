"""`import-mergekit` on the config shapes of mergekit's documentation: each converts to a valid
recipe with mergekit's conventions; what cannot be carried is a clear error."""

from pathlib import Path

import pytest
import yaml

from moemerge.errors import RecipeError
from moemerge.recipe import parse_recipe
from moemerge.recipe.mergekit import convert, render

LINEAR = """
models:
  - model: psmathur/orca_mini_v3_13b
    parameters: {weight: 1.0}
  - model: WizardLM/WizardLM-13B-V1.2
    parameters: {weight: 0.3}
  - model: garage-bAInd/Platypus2-13B
    parameters: {weight: 0.5}
merge_method: linear
dtype: float16
"""
SLERP = """
slices:
  - sources:
      - model: OpenPipe/mistral-ft-optimized-1218
        layer_range: [0, 32]
      - model: mlabonne/NeuralHermes-2.5-Mistral-7B
        layer_range: [0, 32]
merge_method: slerp
base_model: OpenPipe/mistral-ft-optimized-1218
parameters:
  t:
    - filter: self_attn
      value: [0, 0.5, 0.3, 0.7, 1]
    - filter: mlp
      value: [1, 0.5, 0.7, 0.3, 0]
    - value: 0.5
dtype: bfloat16
"""
DARE_TIES = """
models:
  - model: mistralai/Mistral-7B-v0.1
  - model: samir-fama/SamirGPT-v1
    parameters: {density: 0.53, weight: 0.4}
  - model: abacusai/Slerp-CM-mist-dpo
    parameters: {density: 0.53, weight: 0.3}
merge_method: dare_ties
base_model: mistralai/Mistral-7B-v0.1
parameters:
  int8_mask: true
dtype: bfloat16
"""
PASSTHROUGH = """
slices:
  - sources:
    - model: psmathur/orca_mini_v3_13b
      layer_range: [0, 24]
  - sources:
    - model: garage-bAInd/Platypus2-13B
      layer_range: [20, 40]
merge_method: passthrough
dtype: float16
"""
TASK_ARITHMETIC = """
base_model: meta-llama/Llama-2-7b-hf
models:
  - model: a/math
    parameters: {weight: 0.5}
  - model: b/code
    parameters: {weight: 0.5}
merge_method: task_arithmetic
parameters: {lambda: 0.8}
dtype: float32
"""
TIES = """
models:
  - model: base/model
  - model: a/math
    parameters: {density: 0.5, weight: 0.5}
  - model: b/code
    parameters: {density: 0.5, weight: 0.5}
merge_method: ties
base_model: base/model
parameters: {normalize: true}
"""
DELLA = """
models:
  - model: a/x
    parameters: {weight: 1, density: 0.6, epsilon: 0.2}
  - model: b/y
    parameters: {weight: 1, density: 0.6, epsilon: 0.2}
merge_method: della
base_model: base/model
parameters: {lambda: 1.0}
"""
BREADCRUMBS = """
models:
  - model: a/x
    parameters: {weight: 1, density: 0.9, gamma: 0.01}
  - model: b/y
    parameters: {weight: 1, density: 0.9, gamma: 0.01}
merge_method: breadcrumbs_ties
base_model: base/model
"""
SCE = """
models: [{model: a/x}, {model: b/y}, {model: c/z}]
merge_method: sce
base_model: base/model
parameters: {select_topk: 0.1}
"""
MODEL_STOCK = """
models: [{model: a/x}, {model: b/y}, {model: c/z}]
merge_method: model_stock
base_model: base/model
dtype: bfloat16
"""
KARCHER = """
models: [{model: a/x}, {model: b/y}]
merge_method: karcher
parameters: {max_iter: 20, tol: 1.0e-6}
"""
MOE = """
base_model: mistralai/Mistral-7B-Instruct-v0.2
gate_mode: hidden
dtype: bfloat16
experts:
  - source_model: teknium/OpenHermes-2.5-Mistral-7B
    positive_prompts: ["chat", "assistant"]
  - source_model: meta-math/MetaMath-Mistral-7B
    positive_prompts: ["math"]
    negative_prompts: ["story"]
"""


def imported(text):
    return convert(yaml.safe_load(text), "config.yml")


@pytest.mark.parametrize("text", [LINEAR, SLERP, DARE_TIES, PASSTHROUGH, TASK_ARITHMETIC, TIES,
                                  DELLA, BREADCRUMBS, SCE, MODEL_STOCK, KARCHER, MOE],
                         ids=["linear", "slerp", "dare_ties", "passthrough", "task_arithmetic",
                              "ties", "della", "breadcrumbs_ties", "sce", "model_stock",
                              "karcher", "moe"])
def test_documented_shapes_convert_to_valid_recipes(text):
    result = imported(text)
    rendered = render(result, "config.yml")
    assert rendered.startswith("# Imported from config.yml")
    parse_recipe(yaml.safe_load(rendered))  # the comment block is YAML comments


def test_linear_carries_weights_and_dtype():
    r = imported(LINEAR).recipe
    assert r["merge"] == {"method": "average"}
    assert [m["weight"] for m in r["models"]] == [1.0, 0.3, 0.5]
    assert r["output"] == {"dtype": "float16"}


def test_slerp_filters_become_overrides_in_reverse_order_and_base_goes_first():
    r = imported(SLERP).recipe
    assert r["merge"]["t"] == 0.5 and r["merge"]["method"] == "slerp"
    # the same tensor-name substrings; mergekit: first match wins; moemerge: last override wins
    assert r["merge"]["overrides"] == [{"tensors": ["mlp"], "t": [1, 0.5, 0.7, 0.3, 0]},
                                       {"tensors": ["self_attn"], "t": [0, 0.5, 0.3, 0.7, 1]}]
    sources = r["slices"][0]["sources"]
    assert sources[0]["model"] == "OpenPipe/mistral-ft-optimized-1218"
    assert "base_model" not in r


def test_dare_ties_takes_mergekits_conventions_and_notes_what_it_drops():
    result = imported(DARE_TIES)
    merge = result.recipe["merge"]
    assert merge == {"method": "dare_ties", "density": 0.53, "normalize": False,
                     "zero_vote": "positive", "rescale": "l1"}
    assert [m["model"] for m in result.recipe["models"]] == ["samir-fama/SamirGPT-v1",
                                                            "abacusai/Slerp-CM-mist-dpo"]
    assert any("int8_mask" in n for n in result.notes)
    assert any("float32" in n for n in result.notes)  # bfloat16 arithmetic in mergekit


def test_ties_takes_mergekits_sorted_cut_and_the_given_normalize():
    merge = imported(TIES).recipe["merge"]
    assert merge["trim_rounding"] == "sort" and merge["normalize"] is True


def test_moe_maps_gate_mode_and_copies_the_base():
    r = imported(MOE).recipe
    assert (r["kind"], r["merge"], r["router"]) == ("moe", {"method": "base"},
                                                    {"init": "mergekit_hidden"})
    assert r["experts"][1]["negative_prompts"] == ["story"]
    random = imported(MOE.replace("gate_mode: hidden", "gate_mode: random"))
    assert random.recipe["router"] == {"init": "random", "std": 1.0}
    uniform = imported(MOE.replace("gate_mode: hidden", "gate_mode: uniform_random"))
    assert uniform.recipe["router"] == {"init": "uniform"}
    for mode, init in (("hidden_last", "mergekit_hidden"), ("hidden_avg", "mergekit_hidden_avg"),
                       ("cheap_embed", "mergekit_cheap_embed")):
        gated = imported(MOE.replace("gate_mode: hidden", f"gate_mode: {mode}"))
        assert gated.recipe["router"] == {"init": init}, mode


@pytest.mark.parametrize("extra, layout", [
    ("shared_experts: [{source_model: s/x}]\n", None),  # the family's: Llama → DeepSeek-MoE
    ("architecture: deepseek\nshared_experts: [{source_model: s/x}]\n", "deepseek"),
    ("shared_experts: [{source_model: s/x, positive_prompts: [p]}]\n", "qwen2_moe"),
    ("architecture: Qwen\nshared_experts: [{source_model: s/x, positive_prompts: [p]}]\n",
     "qwen2_moe"),
    ("architecture: deepseek\n", "deepseek"),
    ("architecture: qwen3\n", "qwen3_moe"),
])
def test_moe_shared_experts_and_architecture_pick_the_layout(extra, layout):
    """mergekit-moe's choice of output: DeepSeek when the shared expert is ungated (no
    prompts), Qwen when its gate comes from prompts; `architecture:` names one."""
    r = imported(MOE + extra).recipe
    assert r.get("layout") == layout
    shared = yaml.safe_load(extra).get("shared_experts")
    if shared:
        assert r["shared_expert"]["model"] == "s/x"
        assert r["shared_expert"].get("positive_prompts") == shared[0].get("positive_prompts")
    assert parse_recipe(r).shared_expert != "none" or not shared  # a valid moemerge recipe


def test_tokenizer_source_and_block_become_the_recipes_tokenizer():
    union = imported(LINEAR + "tokenizer_source: union\n").recipe
    assert union["tokenizer"] == {"source": "union"}
    block = imported(LINEAR + "tokenizer:\n  source: psmathur/orca_mini_v3_13b\n"
                     "  pad_to_multiple_of: 64\n  tokens:\n"
                     "    <|im_start|>: {source: {kind: zero}}\n"
                     "    <|im_end|>: {source: {kind: model_token, model: "
                     "psmathur/orca_mini_v3_13b, token: '</s>'}, force: true}\n"
                     "    <x>: {source: psmathur/orca_mini_v3_13b}\n").recipe
    assert block["tokenizer"] == {
        "source": "psmathur/orca_mini_v3_13b", "pad_to_multiple_of": 64, "tokens": {
            "<|im_start|>": {"source": "zero", "force": False},
            "<|im_end|>": {"source": {"model": "psmathur/orca_mini_v3_13b", "token": "</s>"},
                           "force": True},
            "<x>": {"source": "psmathur/orca_mini_v3_13b", "force": False}}}
    parse_recipe(block)  # a valid moemerge recipe
    assert "tokenizer" not in imported(LINEAR).recipe  # neither: the base's vocabulary as is


def test_expert_noise_and_residual_scale_are_carried():
    text = MOE.replace('positive_prompts: ["math"]', 'noise_scale: 0.1\n    residual_scale: 0.5'
                       '\n    positive_prompts: [m]') + \
        "shared_experts: [{source_model: s/x, residual_scale: 0.1}]\n"
    r = imported(text).recipe
    assert (r["experts"][1]["noise_scale"], r["experts"][1]["residual_scale"]) == (0.1, 0.5)
    assert r["shared_expert"] == {"model": "s/x", "residual_scale": 0.1}
    parse_recipe(r)


def test_karcher_drops_weights_mergekit_ignores():
    result = imported(KARCHER.replace("{model: a/x}", "{model: a/x, parameters: {weight: 3}}"))
    assert result.recipe["models"] == [{"model": "a/x"}, {"model": "b/y"}]
    assert any("karcher ignores" in n for n in result.notes)


def test_revision_syntax():
    r = imported(LINEAR.replace("psmathur/orca_mini_v3_13b", "org/m@v2")).recipe
    assert r["models"][0] == {"model": "org/m", "revision": "v2", "weight": 1.0}


def test_any_filter_selects_the_same_tensors_by_name():
    # "norm" also matches Qwen3's self_attn.q_norm / k_norm (moemerge's role attn); "q_proj" and
    # "layernorm" match no whole role: name substrings select exactly mergekit's tensors
    text = SLERP.replace("filter: self_attn", "filter: norm").replace("filter: mlp",
                                                                      "filter: q_proj")
    overrides = imported(text).recipe["merge"]["overrides"]
    assert [o["tensors"] for o in overrides] == [["q_proj"], ["norm"]]
    text = SLERP.replace("- filter: mlp", "- filter: '*'")  # mergekit's match-all
    assert imported(text).recipe["merge"]["t"] == [1, 0.5, 0.7, 0.3, 0]


def test_mergekits_per_model_defaults_are_written():
    # mergekit's density defaults to 1 (moemerge's to 0.7 or 0.9): a config without it keeps
    # every entry in mergekit, and so in the recipe
    no_density = TIES.replace("density: 0.5, ", "")
    assert imported(no_density).recipe["merge"]["density"] == 1.0
    crumbs = imported(BREADCRUMBS.replace("density: 0.9, gamma: 0.01", "weight: 1"))
    assert (crumbs.recipe["merge"]["density"], crumbs.recipe["merge"]["gamma"]) == (1.0, 0.01)
    della = imported(DELLA.replace("density: 0.6, epsilon: 0.2", "weight: 1")).recipe["merge"]
    assert (della["density"], della["epsilon"]) == (1.0, 0.15)


def test_per_model_parameters_resolve_as_in_mergekit():
    # a model's own value, else the global one, else the default: one setting for all models
    # goes into the merge block (tunable), else each model keeps its own
    one_own = TIES.replace("density: 0.5, weight: 0.5}\n  - model: b", "weight: 0.5}\n  - model: b")
    r = imported(one_own.replace("{normalize: true}", "{normalize: true, density: 0.5}")).recipe
    assert r["merge"]["density"] == 0.5 and "density" not in r["models"][0]
    r = imported(one_own).recipe  # models.1 falls back to mergekit's default, 1
    assert r["merge"]["density"] == 1.0
    assert ["density" in m and m["density"] for m in r["models"]] == [False, 0.5]
    # the same gradient for every model is a moemerge gradient
    same = TIES.replace("density: 0.5", "density: [0.2, 0.8]")
    assert imported(same).recipe["merge"]["density"] == [0.2, 0.8]
    # a model's filters without a catch-all fall through to the global value, then the default
    filtered = TIES.replace("density: 0.5", "density: [{filter: mlp, value: 0.3}]")
    merge = imported(filtered).recipe["merge"]
    assert merge["density"] == 1.0 and merge["overrides"] == [{"tensors": ["mlp"],
                                                               "density": 0.3}]
    # the base's parameters are unused by mergekit's task-vector methods
    base_density = imported(TIES.replace("- model: base/model",
                                         "- model: base/model\n    parameters: {density: 0.1}"))
    assert base_density.recipe["merge"]["density"] == 0.5
    assert any("models.0.parameters: not carried" in n for n in base_density.notes)
    # a parameter the method does not take is ignored by mergekit: noted, not carried
    crumbs = imported(TASK_ARITHMETIC.replace("lambda: 0.8", "lambda: 0.8, gamma: 0.8"))
    assert "gamma" not in crumbs.recipe["merge"]
    assert any("parameters.gamma: not carried" in n for n in crumbs.notes)
    # mergekit reads lambda from the global parameters only: a per-model lambda is ignored
    own_lambda = imported(TASK_ARITHMETIC.replace("{weight: 0.5}", "{weight: 0.5, lambda: 3}"))
    assert "lambda" not in own_lambda.recipe["models"][0]
    assert any("models.0.parameters.lambda: not carried: mergekit's task_arithmetic ignores a "
               "per-model lambda" in n for n in own_lambda.notes)


def test_mergekits_ties_example_imports_with_its_gradients_and_filters():
    text = (Path(__file__).parent.parent / "data" / "mergekit" / "ties.yml").read_text()
    result = imported(text)
    r = result.recipe
    assert r["merge"] == {"method": "ties", "normalize": True, "density": 1.0,
                          "trim_rounding": "sort", "zero_vote": "positive"}
    assert r["models"] == [
        {"model": "psmathur/orca_mini_v3_13b", "weight": 1.0, "density": [1.0, 0.7, 0.1]},
        {"model": "garage-bAInd/Platypus2-13B", "weight": [0.0, 0.3, 0.7, 1.0],
         "density": 0.5},
        {"model": "WizardLM/WizardMath-13B-V1.0",
         "weight": [{"tensors": ["mlp"], "value": 0.5}, {"value": 0}], "density": 0.33}]
    assert r["base_model"] == {"model": "TheBloke/Llama-2-13B-fp16"}
    parse_recipe(yaml.safe_load(render(result, "ties.yml")))


def test_negative_weights_and_unnormalised_linear_import():
    subtract = imported(TASK_ARITHMETIC.replace("{weight: 0.5}\n  - model: b/code",
                                                "{weight: 1.0}\n  - model: b/code").replace(
        "parameters: {weight: 0.5}\nmerge", "parameters: {weight: -1.0}\nmerge")).recipe
    assert [m["weight"] for m in subtract["models"]] == [1.0, -1.0]
    assert subtract["merge"]["normalize"] is False  # mergekit's task_arithmetic default
    linear = imported(LINEAR + "parameters: {normalize: false}\n").recipe
    assert linear["merge"] == {"method": "average", "normalize": False}
    # TIES's sign election takes no negative weight: refused by the recipe's validation
    with pytest.raises(RecipeError, match="models.0.weight: -0.5 is negative; ties cannot"):
        imported(TIES.replace("density: 0.5, weight: 0.5}\n  - model: b",
                              "density: 0.5, weight: -0.5}\n  - model: b"))


def test_per_source_settings_in_slices_import_source_by_source():
    r = imported(SLICED_TIES).recipe
    assert r["merge"]["density"] == 1.0  # the sources disagree: each keeps its own
    assert [[s["density"] for s in sl["sources"]] for sl in r["slices"]] == [[0.5, 0.5],
                                                                           [0.3, 0.3]]
    scaled = imported(PASSTHROUGH.replace(
        "layer_range: [20, 40]", "layer_range: [20, 40]\n      parameters:\n        scale:\n"
        "          - {filter: o_proj, value: 0.0}\n          - {value: 1.0}")).recipe
    assert scaled["slices"][1]["sources"][0]["scale"] == [
        {"tensors": ["o_proj"], "value": 0.0}, {"value": 1.0}]
    assert "scale" not in scaled["merge"]


SLICED_TIES = """
slices:
  - sources:
      - {model: a/x, layer_range: [0, 2], parameters: {density: 0.5, weight: 1}}
      - {model: b/y, layer_range: [0, 2], parameters: {density: 0.5, weight: 1}}
  - sources:
      - {model: a/x, layer_range: [2, 4], parameters: {density: 0.3, weight: 1}}
      - {model: b/y, layer_range: [2, 4], parameters: {density: 0.3, weight: 1}}
merge_method: ties
base_model: base/model
"""


@pytest.mark.parametrize("text, message", [
    (SLICED_TIES.replace("density: 0.3", "density: [{filter: layers.2., value: 0.3}]"),
     "slices.1.sources.0.parameters.density: filter 'layers.2.' holds a digit"),
    (LINEAR.replace("merge_method: linear", "merge_method: frankenmerge"),
     "'frankenmerge' cannot be imported: not a merge method of mergekit 0.1.5"),
    (LINEAR.replace("psmathur/orca_mini_v3_13b", "a/b+lora/x+y"), "one '+'"),
    (LINEAR + "tokenizer_source: union\ntokenizer: {source: base}\n", "not both"),
    (LINEAR + "tokenizer: {source: base, extra: 1}\n", "tokenizer.extra: not a key"),
    (LINEAR + "modules: {text: {}}\n", "modules: per-module configs"),
    (LINEAR + "sliced: true\n", "sliced: not a mergekit-yaml key"),
    (TASK_ARITHMETIC.replace("lambda: 0.8", "t: 0.8"), "task_arithmetic in moemerge takes no 't'"),
    (MOE + "shared_experts: [{source_model: x}, {source_model: y}]\n",
     "mergekit-moe writes at most one shared expert"),
    (MOE + "architecture: deepseek\nshared_experts: [{source_model: x, positive_prompts: [p]}]\n",
     "DeepSeek output adds its shared expert ungated"),
    (MOE + "architecture: qwen\nshared_experts: [{source_model: x}]\n",
     "sets the shared expert's gate from its positive_prompts"),
    (MOE + "architecture: mixtral\nshared_experts: [{source_model: x}]\n",
     "mixtral output has no shared expert"),
    (MOE.replace("dtype: bfloat16", "architecture: grok"), "architecture: 'grok' is not one"),
    (SLERP.replace("sources:", "parameters: {t: 0.1}\n    sources:", 1), "per-slice parameters"),
])
def test_unsupported_features_are_clear_errors(text, message):
    with pytest.raises(RecipeError, match="config.yml") as info:
        imported(text)
    assert message in str(info.value), str(info.value)


def test_a_mergekit_multi_config_is_named_and_explained(tmp_path):
    """Several YAML documents (mergekit-multi): refused with what it is and what to do, not
    the YAML parser's "expected a single document in the stream"."""
    from moemerge.recipe.load import safe_yaml

    text = LINEAR + "---\nname: second\n" + LINEAR
    with pytest.raises(RecipeError) as info:
        safe_yaml(text, "multi.yml")
    message = str(info.value)
    assert "several YAML documents" in message and "mergekit-multi" in message
    assert "single document in the stream" not in message
    with pytest.raises(RecipeError, match="not valid YAML"):
        safe_yaml("a: [1, 2\n", "broken.yml")
