"""The table of kinds (recipe/kinds.py) is what the build looks up: every entry's stages resolve,
the recipe parser is made from it, and the modules that once tested recipe types look the kind
up instead. Past the build, a built model's config.json reads back to its kind, whose entry says
what finetune, inspect, extract, extend, bake and route do with it; no other module checks a
built model's kind."""

import inspect
import re
from pathlib import Path

import pytest

import moemerge
from moemerge.errors import CheckpointError, RecipeError
from moemerge.recipe.kinds import (
    ASSEMBLIES,
    BY_NAME,
    BY_TAG,
    KINDS,
    OUTPUTS,
    TARGETS,
    Kind,
    kind_of,
    labelled_refs,
)
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


# -- the same table past the build: a built model's config.json read back to its kind --

def test_a_built_models_config_reads_back_as_its_kind():
    from transformers import LlamaConfig, MixtralConfig

    from moemerge.modeling.configuration_moemerge import (
        MoemergeConfig,
        MoemergeLoraConfig,
        MoemergeMergedConfig,
    )

    read = {"seq_routed": {"model_type": "moemerge", "assembly": "seq_routed"},
            "bridged": {"model_type": "moemerge", "assembly": "bridged"},
            "merged_experts": {"model_type": "moemerge_merged"},
            "lora_experts": {"model_type": "moemerge_lora"},
            "token_routed": {"model_type": "qwen3_moe", "num_experts": 4},
            "merge": {"model_type": "llama"}}
    for name, config in read.items():
        assert Kind.of_config(config).name == name, config
    # an MoE of a layout moe.yaml lacks, by its expert count: token_routed; objects too
    assert Kind.of_config({"model_type": "olmoe", "num_experts": 8}).name == "token_routed"
    assert Kind.of_config(MixtralConfig(num_local_experts=4)).name == "token_routed"
    assert Kind.of_config(LlamaConfig()).name == "merge"
    # the table's model types are the shipped classes'
    for config_class, name in ((MoemergeConfig, "seq_routed"), (MoemergeConfig, "bridged"),
                               (MoemergeMergedConfig, "merged_experts"),
                               (MoemergeLoraConfig, "lora_experts")):
        assert BY_NAME[name].model_type == config_class.model_type
    assert {kind.name for kind in OUTPUTS} == set(read)  # upcycle, shrink, stages read as others


@pytest.mark.parametrize("kind", OUTPUTS, ids=lambda k: k.name)
def test_every_command_a_kind_lists_has_its_function_and_no_other(kind):
    for command, field in TARGETS.items():
        listed = command in kind.commands or (command == "extract --weights"
                                              and kind.extract_mixed is not None)
        assert (getattr(kind, field) is not None) == listed, (kind.name, command)
    for field, params in (("extract", ["reader", "config", "expert", "label"]),
                          ("extract_mixed", ["reader", "config", "scores", "label"]),
                          ("extend", ["moe", "out", "experts", "config"]),
                          ("router_modules", ["model"])):
        if getattr(kind, field) is not None:
            found = list(inspect.signature(kind.load(field)).parameters)
            assert found[:len(params)] == params, (kind.name, field, found)


def test_a_command_a_kind_does_not_take_is_refused_naming_those_that_do():
    token = Kind.of_config({"model_type": "mixtral"})
    with pytest.raises(CheckpointError, match=r"^m is a token-routed MoE \(Mixtral / Qwen-MoE "
                       r"layout\); `moemerge bake` takes only merged_experts models$"):
        token.require("bake", "m")
    with pytest.raises(CheckpointError, match="`moemerge route` takes only seq_routed and "
                       "bridged models"):
        token.require("route", "m")
    with pytest.raises(CheckpointError, match=r"m is a dense model; `moemerge extract` takes "
                       "only token_routed, seq_routed, merged_experts and lora_experts models"):
        BY_NAME["merge"].command("extract", "m")
    bridged = Kind.of_config({"model_type": "moemerge", "assembly": "bridged"})
    with pytest.raises(CheckpointError, match="`moemerge extend` takes only token_routed, "
                       "seq_routed and merged_experts models"):
        bridged.command("extend", "m")
    with pytest.raises(RecipeError, match="`moemerge extract --weights` takes only "
                       "merged_experts models"):  # a flag that does not fit: exit 2
        token.command("extract --weights", "m")
    assert BY_NAME["merged_experts"].command("extract --weights", "m").__name__ == \
        "extract_merged"
    BY_NAME["seq_routed"].require("route", "m")  # taken: no error


def test_kind_shapes():
    assert BY_NAME["token_routed"].shape({"model_type": "qwen3_moe", "num_local_experts": 6,
                                          "num_experts_per_tok": 2}) == (6, 2)  # transformers 5
    assert BY_NAME["seq_routed"].shape({"experts": [{}, {}, {}],
                                        "num_experts_per_seq": 1}) == (3, 1)
    assert BY_NAME["merged_experts"].shape({"num_experts": 4}) == (4, 4)
    assert BY_NAME["lora_experts"].shape({"num_experts": 5, "experts_per_token": 2}) == (5, 2)
    assert BY_NAME["merge"].shape({"model_type": "llama"}) == (0, 0)


# kind checks on built models: only modeling/ and this table may make them
KIND_CHECK = re.compile(r"is_(sequence_routed|merged_experts|lora_experts|own_kind)\(|"
                        r"config(\.get\(|\[)[\"']assembly[\"']|model_type[\"']?\)? ?[!=]= ?"
                        r"[\"']moemerge|of_config\([^)]*\)\.name ?[!=]=")
TABLE = ("recipe/kinds.py",)


def test_no_module_outside_the_table_checks_a_built_models_kind():
    for path in sorted(ROOT.rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        if module.startswith("modeling/") or module in TABLE:
            continue
        assert not KIND_CHECK.search(path.read_text()), module


def test_the_kind_check_pattern_finds_what_it_should():
    for text in ("if is_sequence_routed(config):", 'config.get("assembly") != "seq_routed"',
                 "config['assembly'] == 'bridged'", 'config.get("model_type") == "moemerge"',
                 'if Kind.of_config(config).name == "lora_experts":'):
        assert KIND_CHECK.search(text), text
    assert not KIND_CHECK.search("Kind.of_config(config).require('bake', where)")
