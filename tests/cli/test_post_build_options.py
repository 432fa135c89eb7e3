"""`extend`'s and `extract`'s flags are their options models' fields (built/options.py), as
`build`'s are BuildOptions': none missing, none extra, each described by its field, and a bad
combination refused naming its flags before any model is read."""

import pytest
import typer.main
from typer.testing import CliRunner

from moemerge.build_options import options_of
from moemerge.built.options import ExtendOptions, ExtractOptions
from moemerge.cli import app
from moemerge.errors import RecipeError

runner = CliRunner()
ARGUMENTS = {"model", "output"}  # MODEL OUTPUT: where it reads and writes


@pytest.mark.parametrize(("command", "model"), [("extend", ExtendOptions),
                                                ("extract", ExtractOptions)])
def test_every_field_is_a_flag_described_by_it(command, model):
    params = {p.name: p for p in typer.main.get_command(app).commands[command].params}
    assert set(params) - ARGUMENTS == set(model.model_fields)
    for name, info in model.model_fields.items():
        assert params[name].help == info.description, name


@pytest.mark.parametrize(("values", "message"), [
    ({"base": "b"}, "--base, --lora-share and --device go with --lora RANK|auto"),
    ({"lora": "4"}, "--lora: give --base BASE"),
    ({"lora": "4", "base": "b", "lora_share": 0.5}, "--lora-share goes with --lora auto"),
    ({"lora": "auto", "base": "b", "lora_share": 1.5}, r"--lora-share 1.5: give a share in "
                                                       r"\(0, 1\]"),
    ({"lora": "0", "base": "b"}, "--lora '0': give a rank"),
    ({"lora": "four", "base": "b"}, "--lora 'four': give a rank"),
])
def test_extract_refuses_flags_that_do_not_go_together(values, message):
    with pytest.raises(RecipeError, match=f"^{message}"):
        options_of(ExtractOptions, **values)


def test_extract_lora_forms():
    assert options_of(ExtractOptions, lora=" 8 ", base="b").rank == 8
    auto = options_of(ExtractOptions, lora="auto", base="b", lora_share=0.8)
    assert auto.rank is None and not auto.stored
    stored = options_of(ExtractOptions, lora="stored", expert="0")
    assert stored.stored and stored.rank is None  # no --base needed


def test_extend_needs_an_expert_and_says_which_flag():
    with pytest.raises(RecipeError, match="^--expert: List should have at least 1 item"):
        options_of(ExtendOptions, expert=[])
    result = runner.invoke(app, ["extend", "moe", "out"])
    assert result.exit_code == 2 and "--expert" in result.output
