"""The registry drives the schema, the dispatcher, the tuner and the docs: check they agree."""

import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moemerge.cli import app
from moemerge.merge.reference import BEGIN, END, markdown
from moemerge.merge.registry import METHOD_NAMES, REGISTRY, all_params
from moemerge.recipe import parse_recipe, recipe_errors
from moemerge.recipe.merge import param_fields
from moemerge.tune.search import TUNABLE_METHODS

REPO = Path(__file__).resolve().parents[2]
DENSE = {"kind": "merge", "base_model": "b", "models": ["x", "y"]}
MOE = {"kind": "moe", "base_model": "b", "experts": ["x", "y"]}


def test_every_method_resolves_to_its_function():
    for spec in REGISTRY.values():
        assert spec.target is None or callable(spec.function), spec.name
    assert REGISTRY["base"].target is None


def test_a_parameter_name_means_one_thing_everywhere():
    for spec in REGISTRY.values():
        for p in spec.params:
            shared = all_params()[p.name]
            assert (p.kind, p.low, p.high, p.low_closed, p.high_open) == (
                shared.kind, shared.low, shared.high, shared.low_closed, shared.high_open), p.name


# every method's parameters, written out by hand, each with a valid value other than its default
PARAMETERS = {
    "base": {}, "average": {"normalize": False},
    "task_arithmetic": {"lambda": 0.5, "normalize": False},
    "ties": {"density": 0.5, "lambda": 0.5, "trim_rounding": "floor", "normalize": False,
             "zero_vote": "positive", "consensus": "count"},
    "dare_linear": {"density": 0.5, "lambda": 0.5, "normalize": False, "rescale": "l1"},
    "dare_ties": {"density": 0.5, "lambda": 0.5, "rescale": "none", "normalize": False,
                  "zero_vote": "positive", "consensus": "count"},
    "breadcrumbs": {"density": 0.8, "gamma": 0.05, "lambda": 0.5, "normalize": False,
                    "trim_rounding": "floor"},
    "breadcrumbs_ties": {"density": 0.8, "gamma": 0.05, "lambda": 0.5, "trim_rounding": "floor",
                         "normalize": False, "zero_vote": "positive", "consensus": "count"},
    "della": {"density": 0.5, "epsilon": 0.1, "lambda": 0.5, "rescale": "l1", "normalize": False,
              "zero_vote": "positive", "consensus": "count"},
    "della_linear": {"density": 0.5, "epsilon": 0.1, "lambda": 0.5, "normalize": False,
                     "rescale": "none"},
    "sce": {"select_topk": 0.5, "lambda": 0.5, "zero_vote": "positive"},
    "slerp": {"t": 0.25},
    "multislerp": {"normalize": False},
    "karcher": {"max_iter": 3, "tol": 1e-3},
    "model_stock": {"filter_wise": True},
    "passthrough": {"scale": 0.5},
    "nuslerp": {"nuslerp_flatten": False, "nuslerp_row_wise": True},
    "nearswap": {"swap_distance": 0.001},
    "arcee_fusion": {},
    "ram": {"nonzero_threshold": 1e-4},
    "ramplus_tl": {"r": 0.3, "alpha": 0.5, "nonzero_threshold": 1e-4},
}


def test_every_method_and_parameter_is_in_the_schema():
    assert set(PARAMETERS) == set(METHOD_NAMES)
    for method, params in PARAMETERS.items():
        assert {p.name for p in REGISTRY[method].params} == set(params), method
        models = ["x", "y"][:REGISTRY[method].max_models or 2]
        recipe = parse_recipe({**DENSE, "models": models, "merge": {"method": method, **params}})
        assert recipe.merge.method == method
        for name, value in params.items():  # each value arrives under its own field
            assert getattr(recipe.merge, param_fields()[name]) == value, (method, name)


def test_an_unknown_parameter_is_refused_by_name():
    errors = recipe_errors({**DENSE, "merge": {"method": "ties", "densty": 0.5}})
    assert any("densty" in e for e in errors), errors
    errors = recipe_errors({**DENSE, "merge": {"method": "ties", "overrides": [
        {"roles": ["attn"], "lamda": 0.5}]}})
    assert any("lamda" in e for e in errors), errors


def test_the_recipe_layer_imports_no_torch():
    code = "import sys, moemerge.recipe.load; print('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "False"


def test_tunable_parameters_per_method():
    with_density = {"ties", "dare_linear", "dare_ties", "breadcrumbs", "breadcrumbs_ties",
                    "della", "della_linear"}
    expected = {m: ("density", "lambda") if m in with_density else ("lambda",)
                for m in with_density | {"task_arithmetic", "sce"}}
    assert {m: tuple(sorted(s.tunable)) for m, s in REGISTRY.items() if s.tunable} == expected
    assert set(TUNABLE_METHODS) == set(expected)
    help_text = CliRunner().invoke(app, ["build", "--help"], terminal_width=400).output
    assert "Tunable methods: " + ", ".join(sorted(expected, key=METHOD_NAMES.index)) in (
        " ".join(help_text.replace("│", " ").split()))


@pytest.mark.parametrize("merge, message", [
    ({"method": "ties", "t": 0.3}, "t: not a parameter of ties"),
    ({"method": "average", "density": 0.5}, "density: not a parameter of average"),
    ({"method": "slerp", "t": 1.5}, "merge.t: must be in [0, 1]"),
    ({"method": "slerp", "t": [0, 2]}, "merge.t: must be in [0, 1]"),
    ({"method": "della", "epsilon": 1}, "merge.epsilon: must be in [0, 1)"),
    ({"method": "ties", "trim_rounding": "round"}, "merge.trim_rounding"),
    ({"method": "ties", "overrides": [{"roles": ["attn"], "gamma": 0.1}]},
     "overrides.0: gamma: not a parameter of ties"),
    ({"method": "karcher", "max_iter": 0}, "merge.max_iter: must be in (0, inf)"),
    ({"method": "della", "density": 0.9}, "density ± epsilon must lie in (0, 1)"),
    ({"method": "ties", "lambda": float("inf")}, "merge.lambda: must be a finite number"),
    ({"method": "slerp", "t": [0.5, float("nan")]}, "merge.t: must be a finite number"),
    ({"method": "average", "overrides": [{"roles": ["attn"], "method": "della_linear",
                                          "epsilon": 0.7}]}, "density ± epsilon"),
    # a parameter with no default (mergekit requires nearswap's t), and its range
    ({"method": "nearswap"}, "nearswap needs swap_distance (it has no default)"),
    ({"method": "average", "overrides": [{"roles": ["attn"], "method": "nearswap"}]},
     "nearswap needs swap_distance"),
    ({"method": "nearswap", "swap_distance": -0.1}, "merge.swap_distance: must be in [0, inf)"),
    ({"method": "ramplus_tl", "alpha": -1}, "merge.alpha: must be in [0, inf)"),
])
def test_parameters_are_checked_against_the_method(merge, message):
    errors = recipe_errors({**DENSE, "merge": merge})
    assert any(message in e for e in errors), errors


def test_an_override_may_set_a_parameter_of_another_method_of_the_block():
    recipe = parse_recipe({**DENSE, "merge": {"method": "average", "overrides": [
        {"roles": ["attn"], "method": "ties"}, {"layers": [0], "density": 0.5}]}})
    assert recipe.merge.overrides[1].density == 0.5


@pytest.mark.parametrize("data, message", [
    ({**DENSE, "models": ["x", "y", "z"], "merge": {"method": "slerp"}},
     "slerp merges at most 2 models, got 3"),
    ({**DENSE, "models": ["x"], "merge": {"method": "model_stock"}},
     "model_stock needs at least 2 models"),
    ({**MOE, "merge": {"method": "passthrough"}}, "passthrough cannot merge an MoE's shared"),
    ({"kind": "merge", "merge": {"method": "slerp"}, "slices": [
        {"model": "a", "layers": [0, 2]},
        {"sources": [{"model": "a", "layers": [0, 1]}, {"model": "b", "layers": [0, 1]}]}]},
     "slerp needs at least 2 models to merge, got 1"),
    ({**DENSE, "base_model": None, "merge": {"method": "della"}},
     "base_model: merge method(s) della need a base_model"),
    ({**DENSE, "merge": {"method": "nearswap", "swap_distance": 0.1}},
     "nearswap merges at most 1 models, got 2"),
    ({**DENSE, "models": ["x"], "merge": {"method": "nuslerp"}},
     "nuslerp needs at least 2 models to merge, got 1"),
])
def test_method_constraints_name_the_reason(data, message):
    errors = recipe_errors(data)
    assert any(message in e for e in errors), errors


def test_new_methods_are_valid_in_every_kind_that_merges():
    for method in ("slerp", "karcher", "model_stock", "della", "sce", "breadcrumbs_ties"):
        parse_recipe({**MOE, "merge": {"method": method}})
        parse_recipe({**MOE, "assembly": "merged_experts", "merge": {"method": method}})
        parse_recipe({"kind": "moe", "assembly": "seq_routed", "base_model": "b",
                      "experts": ["x", "y"], "merge": {"method": method}})


def test_the_docs_tables_are_generated_from_the_registry():
    text = (REPO / "docs" / "merge-methods.md").read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    assert text[start:end] == markdown(), (
        "docs/merge-methods.md is stale: python -m moemerge.merge.reference docs/merge-methods.md")
    for name in METHOD_NAMES:  # and every method has its formula
        assert f"| `{name}` | " in text[end:], name


def test_methods_command_lists_the_registry():
    result = CliRunner().invoke(app, ["methods"], terminal_width=200)
    assert result.exit_code == 0 and all(n in result.output for n in METHOD_NAMES)
    result = CliRunner().invoke(app, ["methods", "della"], terminal_width=200)
    assert result.exit_code == 0 and "epsilon" in result.output and "0.15" in result.output
    result = CliRunner().invoke(app, ["methods", "nearswap"], terminal_width=200)
    assert result.exit_code == 0 and "swap_distance" in result.output
    result = CliRunner().invoke(app, ["methods", "slurp"])
    assert result.exit_code == 2
