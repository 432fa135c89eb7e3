"""`kind: stages` (mergekit-multi): every error at once with its stage, the build order from the
references, the output stage, and import-mergekit of a config of several documents."""

import pytest
import yaml

from moemerge.errors import RecipeError
from moemerge.recipe.load import parse_recipe, recipe_errors
from moemerge.recipe.mergekit import convert_documents

MERGE = {"kind": "merge", "merge": {"method": "average"}}


def merge_of(*models):
    return {**MERGE, "models": [{"model": m} for m in models]}


def stages(*entries):
    return {"kind": "stages", "stages": list(entries)}


def test_order_follows_the_references_and_the_output_is_the_unnamed_stage():
    recipe = parse_recipe(stages(
        {"recipe": {"kind": "moe", "base_model": "ab", "experts": ["cd", "x/e"]}},
        {"name": "cd", "recipe": merge_of("c", "ab")},
        {"name": "ab", "recipe": merge_of("a", "b")},
    ))
    assert recipe.order() == [2, 1, 0] and recipe.output_index == 0
    assert recipe.reads(0) == {"ab", "cd"} and recipe.reads(2) == set()
    assert [r.model for r in recipe.inputs] == ["x/e", "c", "a", "b"]
    made = recipe.stage_recipe(0, {"ab": "/out.stages/ab", "cd": "/out.stages/cd"})
    assert made["base_model"] == "/out.stages/ab" and made["experts"] == ["/out.stages/cd", "x/e"]


def test_with_every_stage_named_the_output_is_the_one_no_other_reads():
    recipe = parse_recipe(stages({"name": "final", "recipe": merge_of("ab", "c")},
                                 {"name": "ab", "recipe": merge_of("a", "b")}))
    assert recipe.output_index == 0


@pytest.mark.parametrize("name", ["..", ".", "a/b", "../up", "a\\b", "nul\x00"])
def test_a_stage_name_is_a_directory_of_its_own(name):
    """OUT.stages/<name> is where the stage is written: '..' would be OUT's parent."""
    (error,) = recipe_errors(stages({"name": name, "recipe": merge_of("a", "b")},
                                    {"recipe": merge_of(name, "c")}))
    assert error.startswith("stages.0.name: ") and "a stage name is a directory name" in error
    assert not recipe_errors(stages({"name": ".hidden", "recipe": merge_of("a", "b")},
                                    {"recipe": merge_of(".hidden", "c")}))


@pytest.mark.parametrize(("entries", "message"), [
    (({"name": "s", "recipe": merge_of("a", "b")}, {"name": "s", "recipe": merge_of("s", "c")}),
     "two stages are named 's'"),
    (({"recipe": merge_of("a", "b")}, {"recipe": merge_of("c", "d")}),
     "more than one stage has no name"),
    (({"name": "p", "recipe": merge_of("q", "a")}, {"name": "q", "recipe": merge_of("p", "b")},
      {"recipe": merge_of("p", "q")}), "a cycle: p -> q -> p"),
    (({"name": "p", "recipe": merge_of("a", "b")}, {"name": "q", "recipe": merge_of("c", "d")}),
     "which stage is the output? Leave its name out (the stages no other reads: p, q)"),
    (({"recipe": stages({"recipe": merge_of("a", "b")})},), "a stage is one recipe, not stages"),
    (({"recipe": {**merge_of("a", "b"), "merge": {"method": "tiess"}}},),
     "stages[0].recipe.merge.method"),
])
def test_bad_stages_name_the_stage(entries, message):
    errors = recipe_errors(stages(*entries))
    assert any(message in e for e in errors), errors


def test_a_mergekit_multi_config_imports_as_stages():
    documents = list(yaml.safe_load_all("""
name: code-math
merge_method: linear
models:
  - {model: org/code, parameters: {weight: 1.0}}
  - {model: org/math, parameters: {weight: 1.0}}
---
merge_method: linear
models:
  - {model: code-math, parameters: {weight: 0.5}}
  - {model: org/chat, parameters: {weight: 0.5}}
"""))
    imported = convert_documents(documents, "multi.yml")
    assert imported.kind == "mergekit-multi"
    recipe = parse_recipe(imported.recipe)
    assert [s.name for s in recipe.stages] == ["code-math", None]
    assert recipe.order() == [0, 1] and recipe.output_index == 1
    assert recipe.reads(1) == {"code-math"}
    with pytest.raises(RecipeError, match="multi.yml: holds no config"):
        convert_documents([], "multi.yml")
    with pytest.raises(RecipeError, match="document 2: name: a stage name is a string"):
        convert_documents([documents[0], {**documents[1], "name": 3}], "multi.yml")
