"""Item 9: config.json's shape fields are checked against the tensor headers at plan time
(num_hidden_layers 10^12 used to hang the output check)."""

import json
import shutil
import time

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
])
def test_config_shape_fields_must_match_the_tensors(model_factory, tmp_path, field, value,
                                                    message):
    import re

    base = model_factory("llama")
    liar = shutil.copytree(base, tmp_path / "liar")
    config = json.loads((liar / "config.json").read_text())
    config[field] = value
    if value is None:
        del config[field]
    (liar / "config.json").write_text(json.dumps(config))
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: moe\nbase_model: {liar}\n"
                          f"experts: [{liar}]\nexperts_per_token: 1\n")
    start = time.perf_counter()
    result = CliRunner().invoke(app, ["build", str(recipe), str(tmp_path / "out")])
    text = " ".join(result.output.split())
    assert time.perf_counter() - start < 10
    assert result.exit_code == 1 and re.search(message, text), text
    assert "config.json" in text or "tensor" in text
    assert not (tmp_path / "out").exists()
