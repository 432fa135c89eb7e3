"""Every command's --help reads like a good Click tool's, and its text is pinned by a snapshot
(tests/cli/help.snapshot; rewrite it with MOEMERGE_UPDATE_SNAPSHOT=1 after a deliberate change)."""

import os
import re
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from moemerge.cli import app

SNAPSHOT = Path(__file__).with_name("help.snapshot")
runner = CliRunner()


def _commands():
    """{"build": ..., "inspect": ..., "inspect routing": ...}: commands and subcommands."""
    group = typer.main.get_command(app)
    found = {}
    for name in sorted(group.commands):
        found[name] = command = group.commands[name]
        found |= {f"{name} {sub}": command.commands[sub]
                  for sub in sorted(getattr(command, "commands", {}))}
    return group, found


def _help(*args: str) -> str:
    result = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output


def _shown(text: str) -> str:
    """A help text as the reader sees it: help texts are plain text, escaped for Typer's rich
    markup (`\\[gguf]`), so the words in square brackets print as they are."""
    return text.replace("\\[", "[")


def _described(name: str, command) -> list[str]:
    lines = [f"## {name}: {_shown(command.help.splitlines()[0])}"]
    if getattr(command, "default_command", None):
        lines.append(f"default command: {command.default_command} (its options in --help)")
    for param in command.params:
        names = "/".join(param.opts) if param.param_type_name == "option" else param.name.upper()
        lines.append(f"{names}: {_shown(param.help)}")
    return lines


def test_help_reads_like_a_click_tool():
    group, commands = _commands()
    for name in ["", *commands]:
        text = _help(*name.split())
        assert not re.search(r"<(bool|str|int|float|path|list\[[^]]*\])[^>]*>", text), text
        usage = text.split("Usage:")[1].splitlines()[0]
        assert not re.search(r"\{\w+\}", usage), usage
        assert not re.search(r" \.(\s|$)", text), (name, text)  # a description's stray " ."
    for command in commands.values():
        for param in command.params:
            assert param.help and param.help.strip(), (command.name, param.name)
    train = next(p for p in commands["finetune"].params if p.name == "train")
    assert "curvature" in train.help and "curvature" in _help("finetune")
    assert "Usage: moemerge build [OPTIONS] RECIPE [OUTPUT]" in _help("build")
    assert "--trust-remote-code" in _help("finetune")


def test_help_snapshot():
    group, commands = _commands()
    text = "\n".join(line for name, command in commands.items()
                     for line in _described(name, command)) + "\n"
    if os.environ.get("MOEMERGE_UPDATE_SNAPSHOT"):
        SNAPSHOT.write_text(text)
    assert text == SNAPSHOT.read_text(), "help changed: review, then MOEMERGE_UPDATE_SNAPSHOT=1"


def _words(text: str) -> str:
    """Rendered help reduced to its words: box drawing gone, every run of spaces one space."""
    return " " + " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split()) + " "


def _listed(command) -> list:
    """The parameters a command's --help must list: its own, and for a group with a default
    command (`inspect BASE EXPERT...` runs `inspect task-vectors`) the default's too."""
    default = getattr(command, "default_command", None)
    params = list(command.params) + (list(command.commands[default].params) if default else [])
    return [p for p in params if not getattr(p, "hidden", False)]


@pytest.mark.parametrize("columns", ["80", "400"])
def test_every_help_lists_each_option_with_all_of_its_text(columns):
    """`--help` of every command and group names each of its options and prints each help text
    whole, every word, the ones in square brackets too (`the [gguf] extra` once printed as
    `the  extra`: rich read `[gguf]` as markup); `inspect --help` lists task-vectors' options."""
    group, commands = _commands()
    for name, command in {"": group, **commands}.items():
        result = runner.invoke(app, [*name.split(), "--help"],
                               env={"COLUMNS": columns, "NO_COLOR": "1"})
        assert result.exit_code == 0, result.output
        shown = _words(result.output)
        assert _words(_shown(command.help)) in shown, (name, command.help, result.output)
        for param in _listed(command):
            label = param.opts if param.param_type_name == "option" else [
                param.metavar or param.name.upper()]
            for opt in label:
                assert f" {opt} " in shown, (name, opt, result.output)
            assert _words(_shown(param.help)) in shown, (name, param.help, result.output)
            for bracketed in re.findall(r"\[[^\]]*\]", _shown(param.help)):
                assert bracketed in result.output, (name, bracketed, result.output)
    inspect_help = _words(_help("inspect"))
    for option in ("--plot", "--markdown", "--json", "--recipe", "--density"):
        assert f" {option} " in inspect_help, inspect_help


def test_help_texts_keep_their_square_brackets():
    """A help text with a word in square brackets loses none of it (rich markup)."""
    assert "and the [gguf] extra" in " ".join(_help("build").split())
