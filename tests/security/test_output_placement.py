"""Item 1: OUT never equals, contains or sits inside an input, the recipe's directory or the
working directory; refused with exit 2 before anything is read, with or without --force."""

import shutil

import pytest
from conftest import snapshot, write_recipe
from typer.testing import CliRunner

from moemerge.cli import app


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, " ".join(result.output.split())


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
    code, text = cli("bake", project / "e0", project, "--force")
    assert code == 2 and "contains the input model" in text
    assert snapshot(tmp_path) == before


def test_input_files_are_never_outputs(project, tmp_path, train_text):
    """OUT equal to (or inside) an input file: the recipe, --tune-on text, --config, --data,
    a mergekit config. Refused before anything is read, with or without --force."""
    (tmp_path / "work" / "c.yaml").write_text(f"model: {project / 'e0'}\noutput: c.yaml\n"
                                             f"data: [{train_text}]\n")
    data = tmp_path / "work" / "d.txt"
    data.write_text(train_text.read_text())
    data_dir = tmp_path / "work" / "texts"
    data_dir.mkdir()
    (data_dir / "a.txt").write_text(train_text.read_text())
    before = snapshot(tmp_path)
    recipe = project / "r.yaml"
    for out in (recipe, recipe / "sub"):
        code, text = cli("build", recipe, out, "--force")
        assert code == 2 and "the recipe" in text and "never writes" in text, text
    code, text = cli("build", recipe, data, "--tune-on", data, "--force")
    assert code == 2 and "is the --tune-on text" in text, text
    code, text = cli("finetune", "--config", "c.yaml", "--force", "-q")
    assert code == 2 and "is the config file c.yaml" in text, text
    for spec, out, relation in ((data, data, "is"), (data, data / "x", "is inside"),
                                (f"x={data_dir}", data_dir, "is"),
                                (data_dir, data_dir / "out", "is inside")):
        code, text = cli("finetune", project / "e0", out, "--data", spec, "--force", "-q")
        assert code == 2 and f"{relation} --data" in text, (spec, out, text)
    code, text = cli("import-mergekit", recipe, "-o", recipe, "--force")
    assert code == 2 and "is the mergekit config" in text, text
    assert snapshot(tmp_path) == before


def test_toy_refuses_the_cache_and_the_working_directory(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    (cache / "toy").mkdir(parents=True)
    (tmp_path / "work").mkdir()
    monkeypatch.setenv("MOEMERGE_CACHE", str(cache))
    monkeypatch.chdir(tmp_path / "work")
    before = snapshot(tmp_path)
    for out, expected in ((cache / "toy", "is inside the toy cache"),
                          (cache, "is the toy cache"), (tmp_path, "contains the toy cache"),
                          (".", "is the working directory"),
                          (tmp_path / "work", "is the working directory")):
        code, text = cli("toy", out, "--force")
        assert code == 2 and expected in text, (out, text)
    assert snapshot(tmp_path) == before and sorted(cache.iterdir()) == [cache / "toy"]
