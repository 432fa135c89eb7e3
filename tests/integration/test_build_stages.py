"""`kind: stages` builds each stage as `build` builds that recipe alone: the output equals two
builds run by hand; other stages are whole models beside the output; nothing is replaced
without --force, and a failing stage leaves no output."""

import json

import pytest
import torch
import yaml
from conftest import perturbed_copy, snapshot, write_recipe
from safetensors.torch import load_file
from typer.testing import CliRunner

from moemerge.api import build
from moemerge.cli import app
from moemerge.errors import OutputError, RecipeError


def tensors(out):
    return {p.name: data for p, data in snapshot(out).items() if p.suffix == ".safetensors"}


@pytest.fixture
def models(model_factory, tmp_path):
    base = model_factory("llama")
    return base, [perturbed_copy(base, tmp_path / f"e{i}", scale=0.05, seed=i) for i in range(3)]


def stages_text(base, experts) -> str:
    return yaml.safe_dump({"kind": "stages", "stages": [
        {"recipe": {"kind": "moe", "base_model": str(base), "router": {"init": "random"},
                    "experts": ["code-math", str(experts[2])]}},
        {"name": "code-math", "recipe": {
            "kind": "merge", "base_model": str(base), "merge": {"method": "ties", "density": 0.5},
            "models": [str(experts[0]), str(experts[1])]}},
    ]})


def test_stages_build_what_each_recipe_builds_alone(models, tmp_path):
    base, experts = models
    recipe = write_recipe(tmp_path / "multi.yaml", stages_text(base, experts))
    result = build(recipe, tmp_path / "out", progress=False, verify="structure")
    assert result.whole.stages == {"code-math": tmp_path / "out.stages" / "code-math"}
    assert result.whole.summary() == "2 stages; the others in out.stages/: code-math"

    data = yaml.safe_load(stages_text(base, experts))
    first = write_recipe(tmp_path / "first.yaml", yaml.safe_dump(data["stages"][1]["recipe"]))
    build(first, tmp_path / "by-hand" / "code-math", progress=False, verify="structure")
    final = dict(data["stages"][0]["recipe"],
                 experts=[str(tmp_path / "by-hand" / "code-math"), str(experts[2])])
    second = write_recipe(tmp_path / "second.yaml", yaml.safe_dump(final))
    build(second, tmp_path / "by-hand" / "out", progress=False, verify="structure")

    assert tensors(tmp_path / "out") == tensors(tmp_path / "by-hand" / "out") != {}
    assert tensors(tmp_path / "out.stages" / "code-math") == \
        tensors(tmp_path / "by-hand" / "code-math")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]


def test_nothing_is_replaced_without_force_and_a_bad_stage_leaves_no_output(models, tmp_path):
    base, experts = models
    recipe = write_recipe(tmp_path / "multi.yaml", stages_text(base, experts))
    (tmp_path / "out.stages" / "code-math").mkdir(parents=True)
    with pytest.raises(OutputError, match="code-math already exists; pass --force"):
        build(recipe, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    build(recipe, tmp_path / "out", progress=False, verify="structure", force=True)
    assert (tmp_path / "out.stages" / "code-math" / "config.json").exists()

    broken = yaml.safe_load(stages_text(base, experts))
    broken["stages"][0]["recipe"]["experts"][1] = str(tmp_path / "missing")
    bad = write_recipe(tmp_path / "bad.yaml", yaml.safe_dump(broken))
    with pytest.raises(Exception, match="missing"):
        build(bad, tmp_path / "out2", progress=False)
    assert not (tmp_path / "out2").exists()  # the stage before it is there, whole
    assert (tmp_path / "out2.stages" / "code-math" / "config.json").exists()
    with pytest.raises(RecipeError, match="no dry run"):
        build(recipe, None, dry_run=True, progress=False)
    with pytest.raises(RecipeError, match="kind: stages has no dry run"):
        build(recipe, tmp_path / "planned", dry_run=True, progress=False)
    assert not (tmp_path / "planned.stages").exists()
    seq = yaml.safe_load(stages_text(base, experts))
    seq["stages"][0]["recipe"] = {"kind": "moe", "assembly": "seq_routed",
                                  "experts": ["code-math", str(experts[2])]}
    seq_recipe = write_recipe(tmp_path / "seq.yaml", yaml.safe_dump(seq))
    with pytest.raises(RecipeError, match="--gguf: the output stage is kind: seq_routed"):
        build(seq_recipe, tmp_path / "out3", gguf="f16", progress=False)
    assert not (tmp_path / "out3.stages").exists()  # refused before the first stage


def test_the_cli_says_what_it_built(models, tmp_path):
    base, experts = models
    recipe = write_recipe(tmp_path / "multi.yaml", stages_text(base, experts))
    result = CliRunner().invoke(app, ["build", str(recipe), str(tmp_path / "out"),
                                      "--verify", "structure"])
    assert result.exit_code == 0, result.output
    assert "built" in result.output and "2 stages; the others in out.stages/: code-math" in \
        " ".join(result.output.split())


def test_a_mergekit_multi_config_imports_and_builds(models, tmp_path):
    base, experts = models
    config = tmp_path / "multi.yml"
    config.write_text(
        f"name: pair\nmerge_method: linear\ndtype: float32\nmodels:\n"
        f"  - {{model: {experts[0]}, parameters: {{weight: 1.0}}}}\n"
        f"  - {{model: {experts[1]}, parameters: {{weight: 1.0}}}}\n---\n"
        f"merge_method: task_arithmetic\nbase_model: {base}\ndtype: float32\nmodels:\n"
        f"  - {{model: pair, parameters: {{weight: 0.5}}}}\n"
        f"  - {{model: {experts[2]}, parameters: {{weight: 0.5}}}}\n")
    runner = CliRunner()
    imported = runner.invoke(app, ["import-mergekit", str(config), "-o", str(tmp_path / "r.yaml")])
    assert imported.exit_code == 0, imported.output
    assert "mergekit-multi" in imported.output
    built = runner.invoke(app, ["build", str(tmp_path / "r.yaml"), str(tmp_path / "out"), "-q"])
    assert built.exit_code == 0, built.output
    pair = load_file(tmp_path / "out.stages" / "pair" / "model.safetensors")
    out = load_file(tmp_path / "out" / "model.safetensors")
    e0, e1, e2, b = (load_file(p / "model.safetensors") for p in (*experts, base))
    name = "model.layers.0.mlp.down_proj.weight"
    torch.testing.assert_close(pair[name], (e0[name] + e1[name]) / 2)
    torch.testing.assert_close(out[name], b[name] + 0.5 * (pair[name] - b[name])
                               + 0.5 * (e2[name] - b[name]))
