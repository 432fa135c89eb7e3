"""Item 8: safetensors data_offsets that overlap, leave a gap or leave bytes unclaimed are
refused, naming the file and the tensors (they would silently give wrong weights)."""

import json
import struct

import pytest
from conftest import write_recipe
from typer.testing import CliRunner

from moemerge.cli import app
from moemerge.errors import CheckpointError
from moemerge.io.reader import read_safetensors_header


def write(path, entries, data_size):
    header = json.dumps({n: {"dtype": "F32", "shape": [4], "data_offsets": o}
                         for n, o in entries.items()}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(data_size))
    return path


@pytest.mark.parametrize("entries, size, message", [
    ({"a": [0, 16], "b": [8, 24]}, 24, "'b' .*overlaps tensor 'a'"),
    ({"a": [0, 16], "b": [20, 36]}, 36, "'b' .*leaves a gap after tensor 'a'"),
    ({"a": [4, 20]}, 20, "'a' .*leaves a gap after the header"),
    ({"a": [0, 16]}, 24, "8 bytes after the last tensor \\('a'\\)"),
])
def test_overlaps_and_gaps_are_refused(tmp_path, entries, size, message):
    file = write(tmp_path / "x.safetensors", entries, size)
    with pytest.raises(CheckpointError, match=f"x.safetensors: .*{message}"):
        read_safetensors_header(file)


def test_build_names_file_and_tensors(model_factory, tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    base = model_factory("llama")
    (model / "config.json").write_text((base / "config.json").read_text())
    write(model / "model.safetensors", {"model.norm.weight": [0, 16],
                                        "lm_head.weight": [8, 24]}, 24)
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: merge\nmodels: [{model}, {base}]\n")
    result = CliRunner().invoke(app, ["build", str(recipe), str(tmp_path / "out")])
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "model.safetensors" in text and "overlaps" in text, text
    assert "'lm_head.weight'" in text and "'model.norm.weight'" in text
