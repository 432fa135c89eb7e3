"""Item 7: a YAML alias bomb is refused before it is expanded, with a short message: the
document is never constructed, and counting its growth visits each distinct node once."""

import pytest
import yaml
from conftest import write_recipe
from typer.testing import CliRunner

from moemerge.cli import app

LEVELS = "abcdefghi"
BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{x}: &{x} [{', '.join([f'*{p}'] * 9)}]\n" for p, x in zip(LEVELS, LEVELS[1:], strict=False)
) + "kind: *i\n"  # 9 levels: 9^9 ≈ 387 million strings once expanded


@pytest.mark.parametrize("text", [BOMB, "kind: &k [merge, *k]\n"], ids=["laughs", "recursive"])
def test_alias_bomb_is_refused_before_expansion(tmp_path, monkeypatch, text):
    import moemerge.recipe.load as load

    constructed, visited = [], []
    children = load._children
    monkeypatch.setattr(yaml.SafeLoader, "construct_document",
                        lambda self, node: constructed.append(node))
    monkeypatch.setattr(load, "_children", lambda node: visited.append(node) or children(node))
    distinct = text.count("[") + text.count(",") + text.count(":") + 1  # nodes as written
    recipe = write_recipe(tmp_path / "bomb.yaml", text)
    for command in (["validate", recipe], ["build", recipe, tmp_path / "out"]):
        visited.clear()
        result = CliRunner().invoke(app, [str(a) for a in command])
        assert result.exit_code == 2 and "YAML aliases" in result.output, result.output
        assert len(result.output) < 1000
        assert constructed == []  # the 387 million strings are never made
        assert 0 < len(visited) <= 2 * distinct, (len(visited), distinct)  # not 9^9 visits


def test_a_few_aliases_are_fine(tmp_path):
    recipe = write_recipe(tmp_path / "ok.yaml", "kind: merge\nmodels: [&m a, *m]\n")
    result = CliRunner().invoke(app, ["validate", str(recipe)])
    assert result.exit_code == 0, result.output
