"""`moemerge route`: per-prompt routing of a sequence-routed MoE, as a table and JSON."""

import json

import pytest
from conftest import perturbed_copy, write_recipe
from typer.testing import CliRunner

from moemerge.api import build
from moemerge.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def seq_moe(model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("route")
    base = model_factory("llama")
    experts = [perturbed_copy(base, root / f"e{i}", scale=0.3, seed=i, only="layers.")
               for i in range(3)]
    lines = ["kind: moe", "assembly: seq_routed", f"base_model: {base}", "experts:"]
    lines += [f"  - {{model: {e}, name: {n}}}" for e, n in zip(experts, "abc", strict=True)]
    lines += ["router: {kind: task_vector}", "experts_per_sequence: 2"]
    build(write_recipe(root / "r.yaml", "\n".join(lines) + "\n"), root / "moe", progress=False)
    return root / "moe"


def test_route_prints_each_prompt_and_writes_json(seq_moe, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("def add(a, b):\n\nThe sum of two numbers.\nQ: What is 2 + 3?\n")
    result = runner.invoke(app, ["route", str(seq_moe), str(prompts), "--json",
                                 str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert "by task_vector routing (top-2 of 3)" in result.output
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["schema"] == "moemerge.route/1" and data["experts"] == ["a", "b", "c"]
    assert [p["text"] for p in data["prompts"]] == [
        "def add(a, b):", "The sum of two numbers.", "Q: What is 2 + 3?"]  # blank lines skipped
    for p in data["prompts"]:
        assert len(p["experts"]) == 2
        assert sum(e["weight"] for e in p["experts"]) == pytest.approx(1.0, abs=1e-5)
        assert p["experts"][0]["weight"] >= p["experts"][1]["weight"]


def test_route_overrides_the_router_and_k_and_reads_jsonl(seq_moe, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "Q: What is 2 + 3?"}\n')
    result = runner.invoke(app, ["route", str(seq_moe), str(prompts), "--router", "perplexity",
                                 "-k", "1", "--text-field", "prompt", "--json", "-"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["router"] == "perplexity" and data["experts_per_sequence"] == 1
    assert [len(p["experts"]) for p in data["prompts"]] == [1, 1]
    assert all(p["experts"][0]["weight"] == 1.0 for p in data["prompts"])


@pytest.mark.parametrize("args, code, message", [
    (["--split", "words"], 2, "--split: must be line, paragraph or file"),
    (["--router", "oracle"], 2, "--router: must be learned, perplexity or task_vector"),
    (["-k", "4"], 2, "-k 4: the model has only 3 experts"),
])
def test_route_bad_options(seq_moe, tmp_path, args, code, message):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    result = runner.invoke(app, ["route", str(seq_moe), str(prompts), *args])
    assert result.exit_code == code and message in " ".join(result.output.split()), result.output


def test_route_refuses_token_routed_models_and_bad_jsonl(model_factory, tmp_path, seq_moe):
    base = model_factory("llama")
    recipe = write_recipe(tmp_path / "r.yaml",
                          f"kind: moe\nbase_model: {base}\nexperts: [{base}, {base}]\n")
    build(recipe, tmp_path / "mixtral", progress=False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "hi"}\n')
    result = runner.invoke(app, ["route", str(tmp_path / "mixtral"), str(prompts)])
    assert result.exit_code == 1 and "token-routed MoE routes each token" in result.output
    prompts.write_text('{"txt": "hi"}\n')
    result = runner.invoke(app, ["route", str(seq_moe), str(prompts)])
    assert result.exit_code == 2 and "p.jsonl:1: no string field 'text' (--text-field)" in \
        " ".join(result.output.split())


def test_route_names_a_missing_model_directory(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    result = runner.invoke(app, ["route", str(tmp_path / "nowhere"), str(prompts)])
    assert result.exit_code == 1 and "nowhere does not exist" in result.output
