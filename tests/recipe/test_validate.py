"""`validate` catches what `build` would, without reading a tensor: one message per mistake, in
the writer's words, at the line and column of the YAML, with a "did you mean"; quoted numbers;
local model directories that do not exist; an unknown output layout. `import-mergekit` reports
every problem of a config at once."""

import pytest
from typer.testing import CliRunner

from moemerge.cli import app
from moemerge.errors import RecipeError
from moemerge.recipe.load import load_recipe
from moemerge.recipe.mergekit import convert_documents

runner = CliRunner()

MISTAKES = """\
kind: moe
base_model: base
experts:
  - model: base
    weigth: 2
merge:
  method: tiez
  density: zero
  lambda: "0.5"
router:
  init: calibrte
experts_per_token: "2"
"""


def problems(tmp_path, text: str) -> list[str]:
    (tmp_path / "base").mkdir(exist_ok=True)
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as raised:
        load_recipe(path)
    return [line.strip()[2:] for line in str(raised.value).splitlines()[1:]]


def test_one_message_per_mistake_with_line_column_and_a_suggestion(tmp_path):
    found = problems(tmp_path, MISTAKES)
    assert found == [
        "line 5, column 5: experts.0.weigth: unknown field (misspelt, or not valid here) "
        "(did you mean 'weight'?)",
        "line 7, column 3: merge.method: must be one of " + ", ".join(
            ["base", "average", "task_arithmetic", "ties", "dare_linear", "dare_ties",
             "breadcrumbs", "breadcrumbs_ties", "della", "della_linear", "sce", "slerp",
             "multislerp", "karcher", "model_stock", "nuslerp", "nearswap", "arcee_fusion",
             "ram", "ramplus_tl", "passthrough"]) + "; got 'tiez' (did you mean 'ties'?)",
        "line 8, column 3: merge.density: a number, not the text 'zero': write it without "
        "quotes",
        "line 9, column 3: merge.lambda: a number, not the text '0.5': write it without quotes",
        "line 11, column 3: router.init: must be one of random, uniform, prompts, cheap_embed, "
        "task_vector, calibrate, mergekit_hidden, mergekit_hidden_avg, mergekit_cheap_embed; "
        "got 'calibrte' (did you mean 'calibrate'?)",
        "line 12, column 1: experts_per_token: a number, not the text '2': write it without "
        "quotes",
    ]


def test_a_union_field_is_one_mistake_naming_each_shape(tmp_path):
    found = problems(tmp_path, "kind: merge\nmodels: [base, base]\nmerge:\n  method: ties\n"
                               "  density: {a: 1}\n")
    assert found == ["line 5, column 3: merge.density: must be a number or a list, got "
                     "{'a': 1}"]


def test_a_misspelt_kind_and_assembly_are_suggested(tmp_path):
    assert problems(tmp_path, "kind: mrege\nmodels: [base]\n")[0].endswith(
        "(did you mean 'merge'?)")
    assert problems(tmp_path, "kind: moe\nassembly: seq_route\nexperts: [base]\n")[0].endswith(
        "(did you mean 'seq_routed'?)")


def validate(*paths):
    result = runner.invoke(app, ["validate", *map(str, paths)])
    return result.exit_code, " ".join(result.output.split())


def test_validate_names_a_missing_local_model_and_an_unknown_layout(tmp_path):
    (tmp_path / "base").mkdir()
    path = tmp_path / "r.yaml"
    path.write_text("kind: moe\nbase_model: ./base\nexperts: [./base, ./experts/cod]\n"
                    "layout: mixtrl\n")
    code, text = validate(path)
    assert code == 2
    assert "2 problems" in text and "no directory ./experts/cod" in text
    assert "layout: 'mixtrl' is not one of mixtral" in text and "(did you mean 'mixtral'?)" in text
    (tmp_path / "experts" / "cod").mkdir(parents=True)
    path.write_text("kind: moe\nbase_model: ./base\nexperts: [./base, ./experts/cod, "
                    "my-org/llama-math]\n")
    code, text = validate(path)
    assert code == 0, text
    assert "hub ids, not checked (that needs the network): my-org/llama-math" in text


def test_import_mergekit_reports_every_problem_at_once():
    with pytest.raises(RecipeError) as raised:
        convert_documents([{"merge_method": "ties", "base_model": "a/b", "dtype": "float8",
                            "colour": "red", "models": [{"model": "c/d"}]}], "c.yml")
    text = str(raised.value)
    assert "2 problems" in text and "colour: not a mergekit-yaml key" in text
    assert "dtype: 'float8'" in text
    with pytest.raises(RecipeError) as raised:
        convert_documents([{"name": "one", "merge_method": "tiez", "models": [{"model": "a/b"}]},
                           {"merge_method": "ties", "base_model": "a/b", "colour": "red",
                            "models": [{"model": "one"}]}], "c.yml")
    text = str(raised.value)
    assert "c.yml, document 1: merge_method: 'tiez'" in text
    assert "c.yml, document 2: colour" in text
