"""Item 1: OUT never equals, contains or sits inside an input, the recipe's directory or the
working directory; refused with exit 2 before anything is read, with or without --force."""

import shutil

import pytest
from conftest import write_recipe
from typer.testing import CliRunner

from moemerge.cli import app


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, " ".join(result.output.split())


def snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def project(model_factory, tmp_path, monkeypatch):
    proj = tmp_path / "proj"
    shutil.copytree(model_factory("llama"), proj / "base")
    shutil.copytree(model_factory("llama"), proj / "e0")
    write_recipe(proj / "r.yaml", "kind: moe\nbase_model: base\nexperts: [e0]\n"
                 "experts_per_token: 1\n")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    return proj


def test_build_refuses_outputs_on_its_inputs(project, tmp_path):
    before = snapshot(tmp_path)
    outs = [project, project / "e0", project / "e0" / "inner", project / "base", tmp_path,
            tmp_path / "work", ".", ".."]
    for out in outs:
        for force in ([], ["--force"]):
            code, text = cli("build", project / "r.yaml", out, *force)
            assert code == 2, (out, force, text)
            assert "moemerge never writes" in text or "would delete" in text, text
    assert snapshot(tmp_path) == before  # nothing read, moved or written


def test_finetune_export_and_toy_refuse_too(project, tmp_path, train_text, monkeypatch):
    before = snapshot(tmp_path)
    for out in (project / "e0", project / "e0" / "sub", tmp_path / "work"):
        code, text = cli("finetune", project / "e0", out, "--data", train_text, "--force", "-q")
        assert code == 2 and "choose another output" in text.lower(), text
    data_dir = tmp_path / "work" / "data"
    code, text = cli("finetune", project / "e0", tmp_path / "work", "--data", f"x={data_dir}")
    assert code == 2
    code, text = cli("export", project / "e0", project, "--force")
    assert code == 2 and "contains the input model" in text
    monkeypatch.setenv("MOEMERGE_CACHE", str(tmp_path / "cache"))
    code, text = cli("toy", tmp_path / "cache" / "toy", "--force")
    assert code == 2 and "toy cache" in text
    assert snapshot(tmp_path) == before
