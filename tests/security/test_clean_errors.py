"""Item 10: malformed input is a clean error with the documented exit code (2 for recipes and
usage, 1 for models and runtime), never a traceback. Disk full and a read-only output parent
are in tests/faults/test_disk_full.py."""

import json
import shutil
import struct

import pytest
from conftest import write_recipe
from typer.testing import CliRunner

from moemerge.cli import app


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"traceback: {result.exception!r}\n{result.output}")
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize("content, message", [
    (b"- kind: merge\n- models: [a]\n", "holds a list"),
    (b"42\n", "holds a int"),
    (b"", "holds nothing"),
    (b"kind: merge\nmodels: [\xff\xfe]\n", "not UTF-8"),
    (b"kind: merge\nmodels: [{model: a, weight: 0}, {model: b, weight: 0}]\n", "sum to 0"),
    (b"kind: moe\nbase_model: a\nexperts: [{model: b, name: x}, {model: c, name: x}]\n",
     "'x' given more than once"),
])
def test_bad_recipes_exit_2(tmp_path, content, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(content)
    for command in (["validate", recipe], ["build", recipe, tmp_path / "out"]):
        code, text = cli(*command)
        assert code == 2 and message in text, text


def header_file(path, header: bytes, data=b""):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def broken_copy(base, dst, how):
    model = shutil.copytree(base, dst)
    weights = model / "model.safetensors"
    if how == "dtype list":
        header_file(weights, json.dumps({"x": {"dtype": ["F32"], "shape": [1],
                                               "data_offsets": [0, 4]}}).encode(), bytes(4))
    elif how == "offsets strings":
        header_file(weights, json.dumps({"x": {"dtype": "F32", "shape": [1],
                                               "data_offsets": ["0", "4"]}}).encode(), bytes(4))
    elif how == "nested 100k deep":
        header_file(weights, b"[" * 100_000 + b"]" * 100_000)
    elif how == "weight_map a list":
        (model / "model.safetensors.index.json").write_text('{"weight_map": ["a", "b"]}')
    elif how == "weight_map without names":
        (model / "model.safetensors.index.json").write_text(
            '{"weight_map": {"": "model.safetensors"}}')
    elif how == "weight_map empty":
        (model / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    elif how == "no intermediate_size":
        config = json.loads((model / "config.json").read_text())
        del config["intermediate_size"]
        (model / "config.json").write_text(json.dumps(config))
    elif how == "bad tokenizer.json":
        (model / "tokenizer.json").write_text('{"model": ')
    return model


@pytest.mark.parametrize("how, message", [
    ("dtype list", "malformed header entry"), ("offsets strings", "malformed header entry"),
    ("nested 100k deep", "nested too deeply"), ("weight_map a list", "not a valid index"),
    ("weight_map without names", "must map tensor names to file names"),
    ("weight_map empty", "lists no tensor"),
    ("no intermediate_size", "intermediate_size is missing"),
    ("bad tokenizer.json", "not a valid tokenizer file"),
])
def test_bad_models_exit_1(model_factory, tmp_path, how, message):
    base = model_factory("llama")
    bad = broken_copy(base, tmp_path / "bad", how)
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: merge\nmodels: [{base}, {bad}]\n")
    code, text = cli("build", recipe, tmp_path / "out")
    assert code == 1 and message in text and "bad" in text, text
    assert not (tmp_path / "out").exists()


def test_non_utf8_jsonl_in_finetune_exits_2(tiny_moe, tmp_path):
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    code, text = cli("finetune", tiny_moe, tmp_path / "out", "--data", tmp_path / "d.jsonl", "-q")
    assert code == 2 and "d.jsonl" in text and "UTF-8" in text, text


def test_deeply_nested_jsonl_is_a_data_error(tiny_moe, tmp_path):
    """json.loads raises RecursionError on a line nested 100k deep: a data error naming the
    file and the line, for finetune, inspect --data and route alike."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    for args in (["finetune", tiny_moe, tmp_path / "out", "--data", data, "-q"],
                 ["inspect", tiny_moe, "--data", data, "--label-field", "text"],
                 ["route", tiny_moe, data]):
        code, text = cli(*args)
        assert code == 2 and f"{data}:2: the JSON is nested too deeply" in text, (args, text)
    assert not (tmp_path / "out").exists()
