"""`shrink`'s options are the fields of the `kind: shrink` recipe it writes (and of its
calibration text): none can be missing, and each reaches the recipe the shrink runs."""

import pytest
import typer.main
from typer.testing import CliRunner

import moemerge.built.shrink
from moemerge.cli import app
from moemerge.recipe.base import CalibrationText
from moemerge.recipe.shrink import ShrinkRecipe

runner = CliRunner()
NOT_FIELDS = {"output", "force", "quiet"}  # where and how it writes, not what it makes
RECIPE_WIDE = {"kind", "name", "seed", "output"}  # every recipe's: not shrink's to set


class Captured(Exception):
    pass


def test_every_field_is_an_option_and_every_option_a_field():
    command = typer.main.get_command(app).commands["shrink"]
    names = {p.name for p in command.params}
    fields = (set(ShrinkRecipe.model_fields) - RECIPE_WIDE) | set(
        CalibrationText.model_fields)
    assert fields - names == {"data"}  # the calibration's data is --calibration
    assert names - fields == NOT_FIELDS


@pytest.fixture
def captured(monkeypatch, tmp_path):
    """The recipe shrink would run (the run itself replaced); tmp_path/moe exists."""
    seen = []

    def fake(recipe, out, **_):
        seen.append(recipe)
        raise Captured

    monkeypatch.setattr(moemerge.built.shrink, "shrink", fake)
    (tmp_path / "moe").mkdir()
    return seen


def test_every_option_reaches_the_recipe(captured, tmp_path):
    result = runner.invoke(app, [
        "shrink", str(tmp_path / "moe"), str(tmp_path / "out"), "--calibration", "a.txt",
        "--calibration", "b.txt", "--ratio", "0.5", "--method", "merge", "--saliency",
        "frequency", "--merge-method", "karcher", "--no-repair", "--merge-sample", "64",
        "--max-tokens", "100", "--seq-len", "32", "--text-field", "body"])
    assert isinstance(result.exception, Captured), result.output
    (recipe,) = captured
    assert (recipe.ratio, recipe.experts, recipe.method, recipe.saliency, recipe.merge_method,
            recipe.repair, recipe.merge_sample) == (0.5, None, "merge", "frequency", "karcher",
                                                    False, 64)
    assert (recipe.calibration.data, recipe.calibration.max_tokens, recipe.calibration.seq_len,
            recipe.calibration.text_field) == (["a.txt", "b.txt"], 100, 32, "body")


@pytest.mark.parametrize("flag", ["--repair", None])
def test_the_defaults_are_the_recipes(captured, tmp_path, flag):
    result = runner.invoke(app, ["shrink", str(tmp_path / "moe"), str(tmp_path / "out"),
                                 "--calibration", "a.txt", "--experts", "2",
                                 *([flag] if flag else [])])
    assert isinstance(result.exception, Captured), result.output
    (recipe,) = captured
    assert recipe.repair and recipe.merge_sample == 512 and recipe.calibration.seq_len == 128
    assert (recipe.method, recipe.saliency, recipe.merge_method) == ("merge", "reap", "weighted")
