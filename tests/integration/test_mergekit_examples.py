"""mergekit's own example configs (its repository's examples/ and docs/, kept in
tests/data/mergekit/ with their sources named) each imported by `import-mergekit` and built,
every model they name replaced by a tiny local Llama of the same shape (40 layers: the examples
slice layers [0, 40)), without mergekit; the output loads in transformers and generates. Their
comparison with mergekit itself: benchmarks/mergekit_parity.py --examples."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import perturbed_copy
from transformers import AutoModelForCausalLM

from moemerge.api import build
from moemerge.recipe.mergekit import convert_documents, render
from moemerge.toy.published import mergekit_example_models

EXAMPLES = Path(__file__).parent.parent / "data" / "mergekit"
# the output architecture each example builds
BUILDS = {"linear.yml": "LlamaForCausalLM", "bio-merge.yml": "LlamaForCausalLM",
          "ties.yml": "LlamaForCausalLM", "orcamini-platy-44layer.yml": "LlamaForCausalLM",
          "mega.yml": "LlamaForCausalLM", "arcee_fusion.yml": "LlamaForCausalLM",
          "multimerge.yml": "LlamaForCausalLM", "moe-upcycle.yml": "MixtralForCausalLM",
          "moe-clown-car.yml": "MixtralForCausalLM",
          "moe-shared-expert.yml": "Qwen2MoeForCausalLM"}


def test_every_example_is_listed():
    assert sorted(BUILDS) == sorted(p.name for p in EXAMPLES.glob("*.yml"))


@pytest.fixture(scope="module")
def local_models(model_factory, tmp_path_factory):
    """name in a config -> a tiny model: perturbed copies of one 40-layer Llama."""
    base = model_factory("llama", layers=40, hidden=16, heads=2, kv_heads=1, intermediate=32)
    root, made = tmp_path_factory.mktemp("examples"), {}

    def local(name: str) -> Path:
        if name not in made:
            made[name] = perturbed_copy(base, root / f"m{len(made)}", scale=0.02,
                                        seed=len(made) + 1)
        return made[name]

    return local


@pytest.mark.parametrize("example", sorted(BUILDS))
def test_the_example_imports_and_builds(example, local_models, tmp_path):
    documents = list(yaml.safe_load_all((EXAMPLES / example).read_text()))
    imported = convert_documents(mergekit_example_models(documents, local_models),
                                 example)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(render(imported, example))
    out = tmp_path / "out"
    build(recipe, out, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [BUILDS[example]]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 12]])
    assert model.generate(ids, max_new_tokens=2, do_sample=False).shape == (1, 6)
