"""The recipe schema: strict, every error at once, each naming the file and the field."""

from pathlib import Path

import pytest

from moemerge.errors import RecipeError
from moemerge.plan.params import resolve_merge
from moemerge.recipe.load import load_recipe, parse_recipe, recipe_errors
from moemerge.recipe.models import MergeRecipe, MoERecipe
from moemerge.recipe.sequence import BridgedRecipe, SeqRoutedRecipe

REPO = Path(__file__).resolve().parents[2]
MOE = {
    "kind": "moe",
    "base_model": "base",
    "experts": [{"model": "a", "name": "alpha"}, "b"],
}


def test_minimal_moe_takes_defaults():
    recipe = parse_recipe(MOE)
    assert isinstance(recipe, MoERecipe)
    assert [e.model for e in recipe.experts] == ["a", "b"]
    assert recipe.base_model.model == "base"
    defaults = (recipe.experts_per_token, recipe.merge.method, recipe.router.init)
    assert defaults == (2, "average", "random")


def test_lambda_alias_and_overrides():
    recipe = parse_recipe({
        "kind": "merge", "base_model": "b", "models": ["x", "y"],
        "merge": {"method": "ties", "lambda": 0.5, "density": 0.3,
                  "overrides": [{"roles": ["embed"], "method": "average"}]},
    })
    assert isinstance(recipe, MergeRecipe)
    assert recipe.merge.lam == 0.5 and recipe.merge.overrides[0].roles == ["embed"]


def test_overrides_select_by_tensor_name_substring():
    spec = parse_recipe({"kind": "merge", "models": ["x", "y"], "merge": {
        "method": "slerp", "t": 0.5, "overrides": [
            {"tensors": ["norm"], "t": 0.1}, {"tensors": ["q_norm", "k_norm"], "roles": ["norm"],
                                               "t": 0.9}]}}).merge
    q_norm = "model.layers.0.self_attn.q_norm.weight"  # role attn, but its name holds "norm"
    assert resolve_merge(spec, "attn", 0, 2, tensor=q_norm).get("t") == 0.1
    assert resolve_merge(spec, "attn", 0, 2, tensor=q_norm.replace("norm", "proj")).get("t") == 0.5
    assert resolve_merge(spec, "norm", None, 2, tensor="model.norm.weight").get("t") == 0.1
    assert resolve_merge(spec, "norm", 1, 2, tensor="x.k_norm.y").get("t") == 0.9  # both match
    assert resolve_merge(spec, "norm", None, 2).get("t") == 0.5  # no name: no tensors override


def test_every_error_reported_at_once_with_field_names():
    errors = recipe_errors({
        **MOE, "experts_per_tokn": 2, "merge": {"method": "ties", "density": 1.5},
        "router": {"init": "magic"},
    })
    text = "\n".join(errors)
    assert "experts_per_tokn: unknown field" in text
    assert "merge.density" in text
    assert "router.init" in text
    assert len(errors) == 3


@pytest.mark.parametrize("change, field", [
    ({"kind": "moa"}, "kind"),
    ({"experts": []}, "experts"),
    ({"experts_per_token": 3}, "experts_per_token"),
    ({"merge": {"overrides": [{"roles": ["ffn"], "method": "ties"}]}}, "merge.overrides"),
    ({"merge": {"overrides": [{"method": "ties"}]}}, "merge.overrides.0"),
    ({"merge": {"overrides": [{"tensors": [""], "method": "ties"}]}}, "merge.overrides.0.tensors"),
    ({"merge": {"overrides": [{"tensors": [], "method": "ties"}]}}, "merge.overrides.0.tensors"),
    ({"router": {"init": "prompts"}}, "router.init"),
    ({"merge": {"density": 0}}, "merge.density"),
])
def test_bad_fields_are_named(change, field):
    errors = recipe_errors({**MOE, **change})
    assert errors and any(e.startswith(field) for e in errors), errors


def test_dense_merge_methods_needing_a_base_say_so():
    errors = recipe_errors({"kind": "merge", "models": ["x", "y"], "merge": {"method": "ties"}})
    assert errors == ["base_model: merge method(s) ties need a base_model"]


def test_load_names_the_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("kind: moe\nbase_model: b\nexperts: [a]\nsed: 1\n")
    with pytest.raises(RecipeError, match=r"r\.yaml: 1 recipe error:\n  - line 4, column 1: "
                                          r"sed: unknown field .*did you mean .seed.\?"):
        load_recipe(path)
    path.write_text("kind: [moe\n")
    with pytest.raises(RecipeError, match=r"r\.yaml: not valid YAML"):
        load_recipe(path)
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "missing.yaml")


def test_recipe_errors_exit_with_code_2():
    assert RecipeError.exit_code == 2


BUNDLED = sorted((REPO / "recipes").rglob("*.yaml"))


def test_there_are_bundled_recipes():
    assert {p.name for p in BUNDLED} >= {"toy_moe.yaml", "toy_merge.yaml"}


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: p.name)
def test_every_bundled_recipe_validates(path):
    load_recipe(path)


SEQ = {"kind": "moe", "assembly": "seq_routed", "experts": ["a", {"model": "b", "name": "bee"}]}
BRIDGED = {**SEQ, "assembly": "bridged"}


def test_sequence_kinds_take_their_defaults():
    seq, bridged = parse_recipe(SEQ), parse_recipe(BRIDGED)
    assert isinstance(seq, SeqRoutedRecipe) and isinstance(bridged, BridgedRecipe)
    assert (seq.experts_per_sequence, seq.router.kind, seq.mix, seq.per_expert) == (
        1, "learned", "logits", [])
    assert (bridged.mix, bridged.projectors.init, bridged.projectors.hidden_size) == (
        "hidden", "auto", 0)


@pytest.mark.parametrize("data, message", [
    ({**SEQ, "assembly": "sequence"}, "assembly: must be one of token_routed, seq_routed, bridged"),
    ({**SEQ, "experts_per_sequence": 3}, "experts_per_sequence: 3 is larger than the number"),
    ({**SEQ, "router": {"kind": "task_vector"}}, "base_model: router kind 'task_vector' needs"),
    ({**SEQ, "merge": {"method": "ties"}}, "base_model: merge method(s) ties need a base_model"),
    ({**SEQ, "merge": {"overrides": [{"roles": ["attn"], "method": "average"}]}},
     "merge.overrides: role(s) attn are never merged in seq_routed"),
    ({**SEQ, "mix": "hidden", "per_expert": ["lm_head"]}, "mix: 'hidden' mixes hidden states"),
    ({**SEQ, "router": {"init": "prompts"}}, "router.init: 'prompts' needs positive_prompts"),
    ({**BRIDGED, "router": {"kind": "task_vector"}}, "router.kind: 'task_vector' needs experts"),
    ({**BRIDGED, "tokenizer": "cee"}, "tokenizer: 'cee' is not an expert's name"),
    ({**BRIDGED, "base_model": "x"}, "base_model: unknown field"),
    ({**BRIDGED, "projectors": {"init": "eye"}}, "projectors.init"),
])
def test_sequence_kind_errors_name_their_field(data, message):
    errors = recipe_errors(data)
    assert any(message in e for e in errors), errors


UPCYCLE = {"kind": "upcycle", "model": "dense", "experts": 4}


def test_upcycle_defaults():
    from moemerge.recipe.upcycle import UpcycleRecipe

    recipe = parse_recipe({**UPCYCLE, "granularity": 2})
    assert isinstance(recipe, UpcycleRecipe) and recipe.model.model == "dense"
    assert (recipe.num_experts, recipe.top_k, recipe.router.init, recipe.reinit.ratio,
            recipe.noise) == (8, 4, "virtual_group", 0.0, 0.0)


@pytest.mark.parametrize(("fields", "message"), [
    ({"experts_per_token": 5}, "experts_per_token: 5 is larger than the number of experts (4)"),
    ({"reinit": {"ratio": 1.5}}, "reinit.ratio: Input should be less than or equal to 1"),
    ({"reinit": {"ratio": -0.1}}, "reinit.ratio: Input should be greater than or equal to 0"),
    ({"noise": float("nan")}, "noise: Input should be a finite number"),
    ({"router": {"init": "random", "std": float("inf")}}, "router.std: Input should be a finite"),
    ({"granularity": 0}, "granularity: Input should be greater than or equal to 1"),
    ({"experts": 0}, "experts: Input should be greater than or equal to 1"),
    ({"router": {"init": "prompts"}},
     "router.init: must be one of random, virtual_group; got 'prompts'"),
    ({"base_model": "x"}, "base_model: unknown field"),
])
def test_upcycle_errors_name_the_field(fields, message):
    assert message in "\n".join(recipe_errors({**UPCYCLE, **fields}))


MERGED = {**MOE, "assembly": "merged_experts"}
CALIBRATION = {"data": ["alpha=a.txt", "b=b.txt"]}


@pytest.mark.parametrize("data, message", [
    ({**MOE, "router": {"init": "calibrate"}}, "router.init: 'calibrate' needs a `calibration"),
    ({**MOE, "router": {"init": "random"}, "calibration": CALIBRATION},
     "calibration: given, but router.init is not"),
    ({**SEQ, "router": {"kind": "perplexity"}, "calibration": CALIBRATION},
     "calibration: given, but router.init is not"),
    ({**MOE, "router": {"init": "calibrate"}, "calibration": {**CALIBRATION, "confidence": 0.5}},
     "calibration.confidence: 0.5 is not above 1/2"),
    ({**MOE, "router": {"init": "calibrate"}, "calibration": {"data": []}}, "calibration.data"),
    ({**MOE, "router": {"init": "calibrate"}, "calibration": {**CALIBRATION, "max_tokens": 0}},
     "calibration.max_tokens"),
    ({**SEQ, "router": {"kind": "perplexity", "init": "calibrate"}, "calibration": CALIBRATION},
     "router.init: 'calibrate' sets a learned router's weights"),
    ({**SEQ, "router": {"init": "calibrate"}}, "router.init: 'calibrate' needs"),
    ({**MERGED, "router": {"init": "calibrate"}}, "router.init: 'calibrate' needs"),
])
def test_calibration_errors_name_their_field(data, message):
    errors = recipe_errors(data)
    assert any(message in e for e in errors), errors


def test_calibration_takes_one_text_or_a_list():
    recipe = parse_recipe({**MOE, "router": {"init": "calibrate"},
                           "calibration": {"data": "mixed.txt"}})
    assert recipe.calibration.data == ["mixed.txt"]
    assert (recipe.calibration.max_tokens, recipe.calibration.targets) == (4096, "auto")
    for data in (SEQ, MERGED):
        assert parse_recipe({**data, "router": {"init": "calibrate"},
                             "calibration": CALIBRATION}).router.init == "calibrate"


def test_a_calibration_block_makes_calibrate_the_default_init():
    """Without `router.init`, a recipe with calibration text calibrates (nothing else reads the
    block); an init given explicitly stays, and so do recipes without the block."""
    for data in (MOE, SEQ, MERGED, {**SEQ, "router": {"kind": "learned", "std": 0.1}}):
        assert parse_recipe({**data, "calibration": CALIBRATION}).router.init == "calibrate"
        assert parse_recipe(data).router.init == "random"
    # explicit inits are kept (and refused with the block: see the errors above)
