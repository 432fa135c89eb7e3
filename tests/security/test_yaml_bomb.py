"""Item 7: a YAML alias bomb is refused at once, in little memory, with a short message."""

import time

import pytest
from conftest import write_recipe
from typer.testing import CliRunner

from moemerge.cli import app

LEVELS = "abcdefghi"
BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{x}: &{x} [{', '.join([f'*{p}'] * 9)}]\n" for p, x in zip(LEVELS, LEVELS[1:], strict=False)
) + "kind: *i\n"  # 9 levels: 9^9 ≈ 387 million strings once expanded


@pytest.mark.parametrize("text", [BOMB, "kind: &k [merge, *k]\n"], ids=["laughs", "recursive"])
def test_alias_bomb_is_refused_fast_and_briefly(tmp_path, text):
    recipe = write_recipe(tmp_path / "bomb.yaml", text)
    for command in (["validate", recipe], ["build", recipe, tmp_path / "out"]):
        start = time.perf_counter()
        result = CliRunner().invoke(app, [str(a) for a in command])
        assert time.perf_counter() - start < 2
        assert result.exit_code == 2 and "YAML aliases" in result.output, result.output
        assert len(result.output) < 1000


def test_a_few_aliases_are_fine(tmp_path):
    recipe = write_recipe(tmp_path / "ok.yaml", "kind: merge\nmodels: [&m a, *m]\n")
    result = CliRunner().invoke(app, ["validate", str(recipe)])
    assert result.exit_code == 0, result.output
