"""The table of kinds (recipe/kinds.py) is what the build looks up: every entry's stages resolve,
the recipe parser is made from it, and the modules that once tested recipe types look the kind
up instead."""

import inspect
import re
from pathlib import Path

import pytest

import moemerge
from moemerge.recipe.kinds import ASSEMBLIES, BY_TAG, KINDS, kind_of, labelled_refs
from moemerge.recipe.load import parse_recipe, recipe_errors

STAGES = ("planner", "card", "router", "calibrator", "runner")
ROOT = Path(moemerge.__file__).parent
# each function's parameters, by stage: a kind's target must take them (the callers pass them)
CALLED_WITH = {"planner": ["recipe", "models"], "card": ["recipe", "plan"],
               "router": ["recipe", "models"], "calibrator": ["model", "cal", "stats"],
               "runner": ["recipe", "out"]}


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_stage_of_every_kind_resolves_and_takes_what_its_caller_passes(kind):
    for stage in STAGES:
        if getattr(kind, stage) is None:
            with pytest.raises(LookupError, match=f"{kind.name} has no {stage}"):
                kind.load(stage)
            continue
        target = kind.load(stage)
        params = list(inspect.signature(target).parameters)
        assert params[:len(CALLED_WITH[stage])] == CALLED_WITH[stage], (kind.name, stage)


def test_a_kind_is_a_plan_or_a_runner_and_every_planned_kind_has_a_card():
    for kind in KINDS:
        assert (kind.planner is None) == (kind.runner is not None) == (kind.card is None)
        # routers are an MoE's (a merge's when it merges MoEs)
        assert kind.calibrator is None or kind.moe or kind.takes_moes


def test_the_parser_is_the_table():
    assert len(BY_TAG) == len(KINDS) == len({k.name for k in KINDS})
    assert ASSEMBLIES == ("token_routed", "seq_routed", "bridged", "merged_experts",
                          "lora_experts")
    (error,) = recipe_errors({"kind": "blend"})
    assert error == "kind: must be 'merge', 'moe', 'upcycle', 'shrink' or 'stages', got 'blend'"
    (error,) = recipe_errors({"models": []})
    assert error.startswith("kind: missing; say 'kind: merge' (one dense model merged from "
                            "several), 'kind: moe' (a token-routed MoE")
    (error,) = recipe_errors({"kind": "moe", "assembly": "stacked"})
    assert error.startswith("assembly: must be one of token_routed, seq_routed, bridged, "
                            "merged_experts")


def test_kind_of_and_the_inputs_it_names():
    moe = parse_recipe({"kind": "moe", "base_model": "b", "experts": [
        {"model": "x/e1", "name": "code"}, {"model": "e2"}, {"model": "y/e2"}]})
    assert kind_of(moe).name == "token_routed" and kind_of(moe).tunable
    assert [label for label, _ in labelled_refs(moe)] == ["base", "code", "e2", "e2#3"]
    merge = parse_recipe({"kind": "merge", "models": [{"model": "a"}, {"model": "b"}],
                          "merge": {"method": "average"}})
    assert kind_of(merge).name == "merge" and not kind_of(merge).moe
    bridged = parse_recipe({"kind": "moe", "assembly": "bridged", "tokenizer": "big",
                            "experts": [{"model": "small"}, {"model": "big"}]})
    kind = kind_of(bridged)
    assert kind.tokenizer(bridged) == 1 and not kind.uniform and not kind.gguf


# the modules that dispatched on recipe classes: they look the kind up now
LOOKS_UP = ["api.py", "finish/card.py", "finish/gguf.py", "routing/calibration.py",
            "routing/routers.py", "plan/recipe_plan.py", "recipe/load.py", "cli/build.py"]
TYPE_TEST = re.compile(r"isinstance\([^)]*(Merge|MoE|SeqRouted|Bridged|MergedExperts|LoraExperts|"
                       r"Upcycle|"
                       r"Shrink)Recipe|\.assembly ==|assembly\", \"token_routed\"")


@pytest.mark.parametrize("module", LOOKS_UP)
def test_no_module_of_the_build_path_tests_the_recipe_type(module):
    text = (ROOT / module).read_text()
    assert not TYPE_TEST.search(text), module


def test_the_type_test_pattern_finds_what_it_should():
    assert TYPE_TEST.search("if isinstance(recipe, BridgedRecipe):")
    assert TYPE_TEST.search('assembly = getattr(recipe, "assembly", "token_routed")')
    assert not TYPE_TEST.search("kind = kind_of(recipe)")
