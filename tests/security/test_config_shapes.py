"""Item 9: config.json's shape fields are checked against the tensor headers at plan time
(num_hidden_layers 10^12 used to hang the output check), and their JSON types too."""

import json
import shutil

import pytest
from conftest import write_recipe
from typer.testing import CliRunner

from moemerge.cli import app


@pytest.mark.parametrize("field, value, message", [
    ("num_hidden_layers", 10**12, "num_hidden_layers is 1000000000000 but the tensors have "
                                  "layers 0..1"),
    ("intermediate_size", 96, "mlp.*make it \\[(96, 32|32, 96)\\]"),
    ("hidden_size", 64, "make it"),
    ("num_attention_heads", 8, "(q|o)_proj"),
    ("vocab_size", 10, "embed_tokens.*\\[10, 32\\]"),
    ("intermediate_size", None, "intermediate_size is missing"),
    ("head_dim", {"a": 1}, "head_dim is {'a': 1}; it must be a positive integer"),
    ("head_dim", [8], "head_dim is \\[8\\]; it must be"),
    ("head_dim", "8", "head_dim is '8'; it must be"),
    ("head_dim", True, "head_dim is True; it must be"),
    ("head_dim", 0, "head_dim is 0; it must be"),
    ("num_key_value_heads", {"n": 4}, "num_key_value_heads is {'n': 4}; it must be"),
    ("num_key_value_heads", [4], "num_key_value_heads is \\[4\\]; it must be"),
    ("num_key_value_heads", "4", "num_key_value_heads is '4'; it must be"),
    ("num_key_value_heads", False, "num_key_value_heads is False; it must be"),
    ("num_key_value_heads", 2.0, "num_key_value_heads is 2.0; it must be"),
])
def test_config_shape_fields_must_match_the_tensors(model_factory, tmp_path, monkeypatch,
                                                    field, value, message):
    import re

    from moemerge.io.reader import CheckpointReader

    reads = []
    monkeypatch.setattr(CheckpointReader, "read", lambda self, name: reads.append(name))

    base = model_factory("llama")
    liar = shutil.copytree(base, tmp_path / "liar")
    config = json.loads((liar / "config.json").read_text())
    config[field] = value
    if value is None:
        del config[field]
    (liar / "config.json").write_text(json.dumps(config))
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: moe\nbase_model: {liar}\n"
                          f"experts: [{liar}]\nexperts_per_token: 1\n")
    result = CliRunner().invoke(app, ["build", str(recipe), str(tmp_path / "out")])
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and re.search(message, text), text
    assert f"{liar}/config.json: {field}" in text or "tensor" in text, text
    # refused at plan time: no tensor data read, so no output check (the 10^12 hang) either
    assert reads == []
    assert not (tmp_path / "out").exists()
