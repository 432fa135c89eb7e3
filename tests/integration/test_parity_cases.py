"""benchmarks/parity_cases.py without mergekit: every case's moemerge recipe validates, the
mergekit config of each case imports to the same merge, and a few build on tiny models."""

import sys
from pathlib import Path

import pytest
import yaml
from conftest import perturbed_copy, write_recipe

from moemerge.api import build
from moemerge.plan.params import resolve_merge
from moemerge.recipe import parse_recipe
from moemerge.recipe.mergekit import convert

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from parity_cases import CASES, RANDOM_CASES  # noqa: E402

ALL = CASES + RANDOM_CASES + [c.with_models(1) for c in RANDOM_CASES]
MODELS = [Path("base"), Path("m0"), Path("m1"), Path("m2")]
LAYERS = 4  # the benchmark's models
TENSORS = [("embed", None, "model.embed_tokens.weight"), ("norm", None, "model.norm.weight"),
           ("lm_head", None, "lm_head.weight")] + [
    (role, layer, f"model.layers.{layer}.{suffix}") for layer in range(LAYERS)
    for role, suffix in (("attn", "self_attn.q_proj.weight"), ("attn", "self_attn.q_norm.weight"),
                         ("ffn", "mlp.up_proj.weight"), ("norm", "input_layernorm.weight"))]


def inputs(recipe) -> list[tuple]:
    """(model, layers, weight) of every input, in order: models or slice sources (one slice
    of every layer is the same as `models`)."""
    if recipe.slices:
        out = [(s.model, tuple(s.layers), s.weight) for sl in recipe.slices for s in sl.sources]
        whole = len(recipe.slices) == 1 and all(layers == (0, LAYERS) for _, layers, _ in out)
        return [(m, None, w) for m, _, w in out] if whole else out
    return [(m.model, None, m.weight) for m in recipe.models]


@pytest.mark.parametrize("case", ALL, ids=[c.name for c in ALL])
def test_case_recipes_validate_and_match_the_imported_mergekit_config(case):
    ours = parse_recipe(yaml.safe_load(case.moemerge(MODELS, conventions=True)))
    parse_recipe(yaml.safe_load(case.moemerge(MODELS, conventions=False)))
    imported = parse_recipe(convert(yaml.safe_load(case.mergekit(MODELS))).recipe)
    # the benchmark compares the two tools on what import-mergekit would also write
    assert imported.base_model == ours.base_model
    assert inputs(imported) == inputs(ours)
    for role, layer, name in TENSORS:
        assert (resolve_merge(imported.merge, role, layer, LAYERS, tensor=name)
                == resolve_merge(ours.merge, role, layer, LAYERS, tensor=name)), (name, case.name)


@pytest.fixture(scope="module")
def four(model_factory, tmp_path_factory):
    """The benchmark's inputs in small: a 4-layer base and three noisy copies."""
    base = model_factory("llama", layers=LAYERS)
    root = tmp_path_factory.mktemp("parity")
    return [base] + [perturbed_copy(base, root / f"m{i}", scale=0.01, seed=100 + i)
                     for i in range(3)]


@pytest.mark.parametrize("name", ["ties", "passthrough (slices 3 + 3 layers)",
                                  "slerp (filtered t gradients)", "dare_ties-1"])
def test_some_cases_build(name, four, tmp_path):
    case = next(c for c in ALL if c.name == name)
    recipe = write_recipe(tmp_path / "r.yaml", case.moemerge(four, conventions=True))
    result = build(recipe, tmp_path / "out", progress=False, verify="full")
    layers = 6 if case.name.startswith("passthrough") else LAYERS
    assert result.plan.config["num_hidden_layers"] == layers
