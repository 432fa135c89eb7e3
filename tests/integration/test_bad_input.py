"""Bad input gets a clear error and an exit code, and nothing is lost or half-written."""

import shutil

import torch
from conftest import perturbed_copy, write_recipe
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from moemerge.cli import app

runner = CliRunner()


def run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def recipe_for(tmp_path, base, experts, extra=""):
    body = f"kind: moe\nbase_model: {base}\nexperts: [{', '.join(map(str, experts))}]\n{extra}"
    return write_recipe(tmp_path / "recipe.yaml", body)


def only_expected_entries(tmp_path, *names):
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


def test_existing_output_is_refused_and_kept(model_factory, tmp_path):
    base = model_factory("llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    code, text = run("build", recipe_for(tmp_path, base, [base, base]), out)
    assert code == 1 and "already exists" in text and "--force" in text
    assert (out / "precious.txt").read_text() == "keep me"

    code, _ = run("build", recipe_for(tmp_path, base, [base, base]), out, "--force")
    assert code == 0 and not (out / "precious.txt").exists() and (out / "config.json").exists()
    only_expected_entries(tmp_path, "out", "recipe.yaml")


def test_recipe_errors_exit_2_and_name_file_and_field(tmp_path):
    recipe = write_recipe(tmp_path / "bad.yaml", "kind: moe\nbase_model: b\nexperts: [a]\n"
                          "merge: {method: ties, density: 1.5}\nrouter: {init: magic}\n")
    code, text = run("build", recipe, tmp_path / "out")
    assert code == 2
    assert "bad.yaml: 2 recipe errors" in text and "merge.density" in text and "router.init" in text
    code, text = run("validate", recipe)
    assert code == 2 and "merge.density" in text
    only_expected_entries(tmp_path, "bad.yaml")


def test_missing_model_names_the_path(tmp_path):
    code, text = run("build", recipe_for(tmp_path, tmp_path / "nope", [tmp_path / "nope"] * 2),
                     tmp_path / "out")
    assert code == 1 and "nope" in text and "does not exist" in text
    only_expected_entries(tmp_path, "recipe.yaml")


def test_truncated_checkpoint_names_the_file(model_factory, tmp_path):
    base = model_factory("llama")
    broken = shutil.copytree(base, tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, text = run("build", recipe_for(tmp_path, base, [base, broken]), tmp_path / "out")
    assert code == 1 and "truncated" in text and "broken/model.safetensors" in text
    only_expected_entries(tmp_path, "broken", "recipe.yaml")


def test_shape_mismatch_names_the_tensor_and_models(model_factory, tmp_path):
    base = model_factory("llama")
    wider = model_factory("llama", intermediate=96)
    code, text = run("build", recipe_for(tmp_path, base, [base, wider]), tmp_path / "out")
    assert code == 1 and "intermediate_size" in text
    assert str(wider) in text and str(base) in text


def test_different_vocabularies_are_refused(model_factory, tmp_path):
    base = model_factory("llama")
    other = model_factory("llama", vocab=320)
    code, text = run("build", recipe_for(tmp_path, base, [other, other]), tmp_path / "out")
    assert code == 1 and "vocab" in text


def test_tensor_missing_from_one_expert(model_factory, tmp_path):
    base = model_factory("llama")
    expert = perturbed_copy(base, tmp_path / "holey", scale=0.0, seed=0)
    tensors = load_file(expert / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, expert / "model.safetensors", metadata={"format": "pt"})
    code, text = run("build", recipe_for(tmp_path, base, [base, expert]), tmp_path / "out")
    assert code == 1 and "model.layers.1.self_attn.k_proj.weight" in text and "holey" in text


def test_family_mismatch(model_factory, tmp_path):
    code, text = run("build", recipe_for(tmp_path, model_factory("llama"),
                                         [model_factory("qwen3")] * 2), tmp_path / "out")
    assert code == 1 and "qwen3" in text


def test_pickles_are_refused_unless_allowed(model_factory, tmp_path):
    base = model_factory("llama")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(base / "config.json", pickled)
    torch.save(load_file(base / "model.safetensors"), pickled / "pytorch_model.bin")
    recipe = recipe_for(tmp_path, base, [base, pickled])
    code, text = run("build", recipe, tmp_path / "out")
    assert code == 1 and "pytorch_model.bin" in text and "--allow-pickle" in text
    code, text = run("build", recipe, tmp_path / "out", "--allow-pickle")
    assert code == 0, text


def test_interrupted_build_leaves_nothing_that_looks_complete(model_factory, tmp_path,
                                                              monkeypatch):
    import moemerge.io.writer as writer

    base = model_factory("llama")
    calls = {"n": 0}
    original = writer.ShardedWriter.write

    def failing_write(self, name, tensor):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return original(self, name, tensor)

    monkeypatch.setattr(writer.ShardedWriter, "write", failing_write)
    code, text = run("build", recipe_for(tmp_path, base, [base, base]), tmp_path / "out")
    assert code == 130 and "interrupted" in text
    only_expected_entries(tmp_path, "recipe.yaml")


def test_dry_run_prints_the_plan_and_writes_nothing(model_factory, tmp_path):
    base = model_factory("llama")
    code, text = run("build", recipe_for(tmp_path, base, [base, base],
                                         "merge: {method: ties, lambda: 0.5}\n"),
                     tmp_path / "out", "--dry-run")
    assert code == 0, text
    assert "model.layers.1.block_sparse_moe.experts.1.w2.weight" in text
    assert "ties(lambda=0.5, density=0.7)" in text and "router init=random" in text
    assert "estimated peak memory" in text and "output:" in text
    only_expected_entries(tmp_path, "recipe.yaml")


def test_validate_accepts_good_recipes(tmp_path):
    good = write_recipe(tmp_path / "good.yaml", "kind: merge\nmodels: [a, b]\n")
    code, text = run("validate", good)
    assert code == 0 and "ok" in text


def test_unknown_verify_mode_is_a_usage_error(tmp_path):
    good = write_recipe(tmp_path / "good.yaml", "kind: merge\nmodels: [a, b]\n")
    code, text = run("build", good, tmp_path / "out", "--verify", "sometimes")
    assert code == 2 and "--verify" in text
