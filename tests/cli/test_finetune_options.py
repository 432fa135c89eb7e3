"""`finetune`'s options are TrainConfig's fields: none can be missing or silently dropped."""

import typing

import pytest
import typer.main
from typer.testing import CliRunner

import moemerge.train.api
from moemerge.cli import app
from moemerge.cli.finetune import NOT_FIELDS
from moemerge.train.config import TrainConfig

runner = CliRunner()


class Captured(Exception):
    pass


@pytest.fixture
def captured(monkeypatch):
    """The TrainConfig finetune would train with (the run itself replaced)."""
    seen = []

    def fake(cfg, **_):
        seen.append(cfg)
        raise Captured

    monkeypatch.setattr(moemerge.train.api, "finetune", fake)
    return seen


def _other_value(name, info):
    """A valid command-line value of field `name` that is not its default."""
    if typing.get_origin(info.annotation) is typing.Literal:
        return next(c for c in typing.get_args(info.annotation) if c != info.default)
    kind = next(t for t in (bool, int, float, str) if t in (info.annotation,
                                                            *typing.get_args(info.annotation)))
    return {bool: True, int: 7, float: 0.25, str: "body"}[kind]


def test_every_field_is_an_option_and_every_option_a_field():
    command = typer.main.get_command(app).commands["finetune"]
    names = {p.name for p in command.params}
    assert set(TrainConfig.model_fields) - names == set()
    assert names - set(TrainConfig.model_fields) == NOT_FIELDS


def test_every_option_reaches_the_config(captured, tmp_path):
    args, expected = ["m", "o", "--data", "d.txt", "--train", "curvature"], {}
    for name, info in TrainConfig.model_fields.items():
        if name in ("model", "output", "data", "train"):
            continue
        value = _other_value(name, info)
        flag = "--" + name.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
        expected[name] = value
    result = runner.invoke(app, ["finetune", *args])
    assert isinstance(result.exception, Captured), result.output
    cfg = captured[0]
    assert (cfg.model, cfg.output, cfg.data, cfg.train) == ("m", "o", ["d.txt"], ["curvature"])
    assert {name: getattr(cfg, name) for name in expected} == expected


def test_defaults_do_not_override_the_config_file(captured, tmp_path):
    (tmp_path / "c.yaml").write_text("model: m\noutput: o\ndata: [d.txt]\nseq_len: 64\n"
                                     "force: true\n")
    result = runner.invoke(app, ["finetune", "--config", str(tmp_path / "c.yaml"), "--lr", "0.5"])
    assert isinstance(result.exception, Captured), result.output
    cfg = captured[0]
    assert (cfg.seq_len, cfg.force, cfg.lr, cfg.batch_size) == (64, True, 0.5, 8)


def test_the_default_is_a_step_budget_not_an_epoch(captured):
    """No --steps, no --epochs: DEFAULT_STEPS (stated in --help with its tokens), however much
    data there is; --epochs counts passes over the blocks; --steps wins over --epochs."""
    from moemerge.train.config import DEFAULT_STEPS

    result = runner.invoke(app, ["finetune", "m", "o", "--data", "d.txt"])
    assert isinstance(result.exception, Captured), result.output
    cfg = captured[0]
    assert (cfg.steps, cfg.epochs) == (None, None)
    assert cfg.total_steps(100_000) == cfg.total_steps(10) == DEFAULT_STEPS
    assert cfg.model_copy(update={"epochs": 2.0}).total_steps(100) == 25  # 2 × 100 / batch 8
    assert cfg.model_copy(update={"epochs": 2.0, "steps": 7}).total_steps(100) == 7
    steps = next(p for p in typer.main.get_command(app).commands["finetune"].params
                 if p.name == "steps")
    assert f"default: {DEFAULT_STEPS}" in steps.help and "tokens" in steps.help
