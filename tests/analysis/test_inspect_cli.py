"""`moemerge inspect` on tiny checkpoints: outputs, schema, recipe input, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from moemerge.cli import app

torch.set_num_threads(1)
runner = CliRunner()
GROUP_KEYS = {"role", "layer", "numel", "mean_cosine", "min_cosine", "pairs", "experts",
              "all_sign_conflict"}


def run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output, result


def expert_from(base: Path, out: Path, seed: int, scale: float = 0.02) -> Path:
    shutil.copytree(base, out)
    gen = torch.Generator().manual_seed(seed)
    for file in out.glob("*.safetensors"):
        tensors = {n: t + scale * torch.randn(t.shape, generator=gen).to(t.dtype)
                   for n, t in load_file(file).items()}
        save_file(tensors, file, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def trio(model_factory, tmp_path_factory):
    base = model_factory("llama")
    root = tmp_path_factory.mktemp("inspect")
    return base, [expert_from(base, root / name, i) for i, name in enumerate(("code", "math"))]


def test_tables_json_markdown_plot(trio, tmp_path):
    base, experts = trio
    js, md, png = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"
    code, text, _ = run("inspect", base, *experts, "--json", js, "--markdown", md, "--plot", png)
    assert code == 0, text
    assert "mean cos" in text and "verdict:" in text and "code" in text

    doc = json.loads(js.read_text())
    assert set(doc) == {"schema", "base", "experts", "density", "groups", "summary", "verdict"}
    assert doc["schema"] == "moemerge.inspect/1" and doc["density"] == 0.7
    assert [e["name"] for e in doc["experts"]] == ["code", "math"]
    assert doc["base"]["name"] == "base" and doc["base"]["path"] == str(base.resolve())
    assert set(doc["summary"]) == {"embed", "attn", "norm", "ffn", "lm_head"}
    for group in doc["groups"] + list(doc["summary"].values()):
        assert set(group) == GROUP_KEYS
        assert [set(p) for p in group["pairs"]] == [{"a", "b", "cosine", "sign_conflict"}]
        assert [set(e) for e in group["experts"]] == [
            {"name", "relative_norm", "ties_trimmed_mass"}] * 2
    layers = {(g["role"], g["layer"]) for g in doc["groups"]}
    assert ("embed", None) in layers and ("ffn", 1) in layers and ("norm", None) in layers
    assert isinstance(doc["verdict"], str) and doc["verdict"].endswith(".")

    flat = " ".join(text.split())
    for path, what in ((js, "the report as JSON"), (md, "the tables and verdict as markdown"),
                       (png, "cosine heatmaps")):
        assert f"wrote {what} to {path}" in flat, flat
    text_md = md.read_text()
    assert "| role | mean cos |" in text_md and "| ffn | 1 |" in text_md
    assert str(base.parent) not in text_md and f"base `{base.name}`" in text_md  # no local paths
    assert doc["verdict"] in text_md
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1024


def test_json_to_stdout_and_density(trio):
    base, experts = trio
    code, _, result = run("inspect", base, *experts, "--json", "-", "--density", "0.5", "-q")
    assert code == 0
    doc = json.loads(result.stdout)  # the tables went to stderr
    assert doc["density"] == 0.5
    # independent N(0, σ²) noise: near-orthogonal, signs disagree about half the time,
    # and density 0.5 trims the smaller half of |τ| (~ 8 % of a Gaussian's Σ τ²)
    ffn = doc["summary"]["ffn"]
    assert abs(ffn["pairs"][0]["cosine"]) < 0.1
    assert 0.4 < ffn["pairs"][0]["sign_conflict"] < 0.6
    assert 0.05 < ffn["experts"][0]["ties_trimmed_mass"] < 0.12
    assert "orthogonal" in doc["verdict"]


def test_recipe_input_uses_expert_names(trio, tmp_path):
    base, experts = trio
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"kind: moe\nbase_model: {base}\nexperts:\n"
                      f"  - {{model: {experts[0]}, name: py}}\n  - {{model: {experts[1]}}}\n")
    code, text, _ = run("inspect", "--recipe", recipe, "--json", tmp_path / "r.json")
    assert code == 0, text
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [e["name"] for e in doc["experts"]] == ["py", "math"]


def test_bad_input(model_factory, trio, tmp_path):
    base, experts = trio
    qwen = model_factory("qwen3")
    code, text, _ = run("inspect", base, qwen)
    assert code == 1 and "llama" in text and "qwen3" in text and str(qwen) in text.replace("\n", "")

    code, text, _ = run("inspect", base, tmp_path / "nope")
    assert code == 1 and "nope" in text

    code, text, _ = run("inspect", base)
    assert code == 2 and "EXPERT" in text

    recipe = tmp_path / "merge.yaml"
    recipe.write_text(f"kind: merge\nmodels: [{experts[0]}, {experts[1]}]\n")
    code, text, _ = run("inspect", "--recipe", recipe)
    assert code == 2 and "base_model" in text and "merge.yaml" in text

    code, text, _ = run("inspect", base, *experts, "--density", "0")
    assert code == 2 and "--density" in text
    code, text, _ = run("inspect", base, experts[0], "--plot", tmp_path / "p.png")
    assert code == 2 and "two experts" in text and not (tmp_path / "p.png").exists()
