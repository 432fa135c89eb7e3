"""Every command's --help reads like a good Click tool's, and its text is pinned by a snapshot
(tests/cli/help.snapshot; rewrite it with MOEMERGE_UPDATE_SNAPSHOT=1 after a deliberate change)."""

import os
import re
from pathlib import Path

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


def _described(name: str, command) -> list[str]:
    lines = [f"## {name}: {command.help.splitlines()[0]}"]
    for param in command.params:
        names = "/".join(param.opts) if param.param_type_name == "option" else param.name.upper()
        lines.append(f"{names}: {param.help}")
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
