"""Item 14: duplicate expert names are errors, override layers beyond the model a warning
naming the field, and a reference that looks like a path never reaches the hub."""

import huggingface_hub
import pytest
from conftest import write_recipe
from typer.testing import CliRunner

from moemerge.cli import app
from moemerge.errors import CheckpointError
from moemerge.io.resolve import resolve_model


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, " ".join(result.output.split())


def test_duplicate_expert_names(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", "kind: moe\nassembly: seq_routed\nbase_model: a\n"
                          "experts: [{model: b, name: code}, {model: c, name: code}]\n")
    code, text = cli("validate", recipe)
    assert code == 2 and "experts: expert name(s) 'code' given more than once" in text, text


def test_override_layers_beyond_the_model_warn(model_factory, tmp_path):
    base = model_factory("llama")  # 2 layers
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: merge\nbase_model: {base}\n"
                          f"models: [{base}]\nmerge:\n  method: task_arithmetic\n  overrides:\n"
                          "    - {layers: [0], method: base}\n"
                          "    - {layers: [1, 7], method: base}\n")
    code, text = cli("build", recipe, "--dry-run")
    assert code == 0, text
    assert "merge.overrides[1].layers: [7] beyond the output's 2 layers" in text
    assert "overrides[0]" not in text


def test_override_layers_of_a_slices_merge_count_the_output_layers(model_factory, tmp_path):
    base = model_factory("llama")  # 2 layers; the slices stack 3
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: merge\nslices:\n"
                          f"  - {{model: {base}, layers: [0, 2]}}\n"
                          f"  - {{model: {base}, layers: [1, 2]}}\n"
                          "merge:\n  method: passthrough\n  overrides:\n"
                          "    - {layers: [2], method: passthrough}\n"
                          "    - {layers: [3], method: passthrough}\n")
    code, text = cli("build", recipe, "--dry-run")
    assert code == 0, text
    assert "merge.overrides[1].layers: [3] beyond the output's 3 layers (0..2)" in text, text
    assert "overrides[0]" not in text  # layer 2 exists in the output, not in the inputs


@pytest.mark.parametrize("ref", ["r.yaml", "model.safetensors", "local/name", "weights.bin"])
def test_path_like_references_never_reach_the_hub(tmp_path, monkeypatch, ref):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "local").mkdir()  # `local/name`: its first part is an existing directory
    monkeypatch.setattr(huggingface_hub, "snapshot_download", pytest.fail)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model(ref)
    (tmp_path / "r.yaml").write_text("kind: merge\n")
    with pytest.raises(CheckpointError, match="is a file"):
        resolve_model("r.yaml")


def test_bare_recipe_name_as_model_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", pytest.fail)
    recipe = write_recipe(tmp_path / "r.yaml", "kind: merge\nmodels: [r.yaml, other.yaml]\n")
    code, text = cli("build", recipe, tmp_path / "out")
    assert code == 1 and "model r.yaml is the file" in text, text
