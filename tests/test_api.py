"""The build API: a recipe object builds what its file builds, options are one model (the CLI's
flags), what a kind cannot do is refused before any tensor is read, and `--dry-run` shows each
tensor's change (upcycled slices)."""

import pytest
from conftest import perturbed_copy, snapshot, write_recipe

from moemerge.api import RecipeSource, build, build_file
from moemerge.build_options import BuildOptions, TuneOptions, tune_options
from moemerge.errors import RecipeError
from moemerge.recipe.load import load_recipe

MOE = "kind: moe\nbase_model: {base}\nexperts: [{e0}, {e1}]\nrouter: {{init: random}}\n"


def moe_recipe(tmp_path, model_factory):
    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.05, seed=i) for i in range(2)]
    return write_recipe(tmp_path / "r.yaml", MOE.format(base=base, e0=experts[0],
                                                        e1=experts[1]))


def tensors(out):
    return {p.name: data for p, data in snapshot(out).items() if p.suffix == ".safetensors"}


def test_a_recipe_object_builds_what_its_file_builds(model_factory, tmp_path):
    path = moe_recipe(tmp_path, model_factory)
    from_file = build_file(path, tmp_path / "a", BuildOptions(verify="structure"),
                           progress=False)
    recipe = load_recipe(path)  # absolute model paths: nothing to resolve against a directory
    from_object = build(recipe, tmp_path / "b", BuildOptions(verify="structure"), progress=False)
    assert tensors(tmp_path / "a") == tensors(tmp_path / "b") != {}
    assert len(from_file.plan.jobs) == len(from_object.plan.jobs)
    # the object's recipe copy is its fields as YAML, and it builds again
    copied = tmp_path / "b" / "moemerge_recipe.yaml"
    assert load_recipe(copied) == recipe
    assert RecipeSource.of(recipe).name == "<recipe>"


def test_option_keywords_are_the_options_model(model_factory, tmp_path):
    path = moe_recipe(tmp_path, model_factory)
    with pytest.raises(TypeError, match="no option bogus"):
        build(path, tmp_path / "out", bogus=1)
    with pytest.raises(TypeError, match="not both"):
        build(path, tmp_path / "out", BuildOptions(), force=True)
    with pytest.raises(RecipeError, match="--workers: must be at least 1, got 0"):
        build(path, tmp_path / "out", workers=0)
    assert not (tmp_path / "out").exists()


def test_every_build_flag_is_an_option_field_and_described_once():
    from typer.main import get_command

    from moemerge.cli import app

    build_command = get_command(app).commands["build"]
    flags = {p.name for p in build_command.params} - {"recipe", "output", "quiet"}
    tune_flags = {f"tune_{name}" for name in TuneOptions.__pydantic_fields__} - {"tune_text"}
    assert flags == (set(BuildOptions.model_fields) - {"tune"}) | tune_flags | {"tune_on"}
    described = {p.name: p.help for p in build_command.params}
    for name, field in BuildOptions.model_fields.items():
        if name != "tune":
            assert described[name].replace("\\[", "[").startswith(field.description), name


def test_what_a_kind_cannot_do_is_refused_before_any_model_is_read(tmp_path):
    recipe = write_recipe(tmp_path / "seq.yaml", "kind: moe\nassembly: seq_routed\n"
                          "experts: [missing-a, missing-b]\n")
    with pytest.raises(RecipeError, match="--gguf: a seq_routed output runs moemerge's own "
                                          "modeling code.*merge, token_routed, upcycle"):
        build(recipe, tmp_path / "out", gguf="f16")
    with pytest.raises(RecipeError, match="--tune-on: only merge and token_routed recipes .* "
                                          "is kind: seq_routed"):
        build(recipe, tmp_path / "out", tune=TuneOptions(tmp_path / "held.txt"))
    with pytest.raises(RecipeError, match="--gguf: must be one of"):
        build(recipe, tmp_path / "out", gguf="q3")


def test_a_bad_tune_flag_names_the_flag():
    with pytest.raises(RecipeError, match="--tune-lambdas: expected comma-separated numbers, "
                                          "all finite, got '0.5,x'"):
        tune_options("held.txt", lambdas="0.5,x")


def test_the_dry_run_shows_what_each_upcycled_expert_is(model_factory, tmp_path):
    dense = model_factory("llama")
    recipe = write_recipe(tmp_path / "up.yaml", f"kind: upcycle\nmodel: {dense}\nexperts: 2\n"
                          "granularity: 2\nnoise: 0.01\n")
    plan = build(recipe, None, dry_run=True, progress=False).plan
    described = {job.output: plan.describe_job(job) for job in plan.jobs}
    name = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    assert described[name] == (f"copy {dense.name}:model.layers.0.mlp.down_proj.weight as "
                               "copy 1 (noise std 0.01), slice 2/2 ×2")
