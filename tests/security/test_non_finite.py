"""Item 6: every float in a recipe is finite; NaN/Inf in an input tensor is a warning naming
the tensor and the model (an error with --strict); a non-finite output is refused unless
--allow-non-finite."""

import pytest
import torch
from conftest import write_recipe
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from moemerge.cli import app


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize("field, text", [
    ("merge.lambda", "merge: {method: task_arithmetic, lambda: .nan}"),
    ("merge.lambda", "merge: {method: ties, lambda: .inf}"),
    ("models.1.weight", "models: [a, {model: b, weight: .inf}]"),
    ("router.std", "router: {std: .inf}"),
])
def test_recipe_floats_must_be_finite(tmp_path, field, text):
    head = "kind: merge\nbase_model: a\n" if field.startswith(("merge", "models")) else \
        "kind: moe\nbase_model: a\nexperts: [b]\nexperts_per_token: 1\n"
    body = head + text + ("\n" if "models" in text else "\nmodels: [a, b]\n"
                          if head.startswith("kind: merge") else "\n")
    recipe = write_recipe(tmp_path / "r.yaml", body)
    code, out = cli("validate", recipe)
    assert code == 2 and field in out and "finite" in out, out


def test_nan_inputs_warn_strict_refuses_output_check_refuses(model_factory, tmp_path):
    base = model_factory("llama")
    bad = tmp_path / "bad"
    bad.mkdir()
    for file in base.iterdir():
        (bad / file.name).write_bytes(file.read_bytes())
    tensors = load_file(bad / "model.safetensors")
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: merge\nmodels: [{base}, {bad}]\n")
    out = tmp_path / "out"
    code, text = cli("build", recipe, out, "--strict")
    assert code == 1 and "'model.norm.weight'" in text and str(bad) in text, text
    code, text = cli("build", recipe, out)
    assert "warning" in text and "'model.norm.weight'" in text and "NaN/Inf" in text, text
    assert code == 1 and "output check failed" in text and "--allow-non-finite" in text, text
    assert not out.exists()
    code, text = cli("build", recipe, out, "--allow-non-finite", "--verify", "structure")
    assert code == 0, text
    assert torch.isnan(load_file(out / "model.safetensors")["model.norm.weight"]).any()


def test_a_tensor_copied_unchanged_is_checked_without_being_read(model_factory, tmp_path,
                                                                monkeypatch):
    """A token-routed MoE's expert FFNs go from input file to output file by the kernel, never
    read into the process: a NaN in one is still found (warning, --strict, the output check),
    and with --allow-non-finite its bytes arrive as they were."""
    from moemerge.io.reader import CheckpointReader

    base = model_factory("llama")
    bad = tmp_path / "bad"
    bad.mkdir()
    for file in base.iterdir():
        (bad / file.name).write_bytes(file.read_bytes())
    name = "model.layers.1.mlp.down_proj.weight"
    tensors = load_file(bad / "model.safetensors")
    tensors[name][2, 3] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    read: list[str] = []
    real_read = CheckpointReader.read
    monkeypatch.setattr(CheckpointReader, "read",
                        lambda self, n: read.append(n) or real_read(self, n))
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: moe\nbase_model: {base}\nexperts: "
                          f"[{base}, {bad}]\nexperts_per_token: 1\n")
    out = tmp_path / "out"
    code, text = cli("build", recipe, out, "--strict")
    assert code == 1 and f"'{name}'" in text and str(bad) in text, text
    code, text = cli("build", recipe, out)
    assert "warning" in text and f"'{name}'" in text and "NaN/Inf" in text, text
    assert code == 1 and "output check failed" in text and "--allow-non-finite" in text, text
    assert not out.exists()
    read.clear()
    code, text = cli("build", recipe, out, "--allow-non-finite", "--verify", "structure")
    assert code == 0, text
    assert not [n for n in read if ".mlp." in n], read  # random routers read no FFN either
    built = load_file(out / "model.safetensors")
    copied = built["model.layers.1.block_sparse_moe.experts.1.w2.weight"]
    assert torch.equal(copied.view(torch.int16), tensors[name].view(torch.int16))
