"""The table of recipe kinds: what `build` does for each, looked up instead of tested for.

A kind is a recipe's `kind:` with, for `kind: moe`, its `assembly:` (the MoE layout): `merge`,
`token_routed`, `seq_routed`, `bridged`, `merged_experts`, `lora_experts`, `upcycle` and
`shrink`. Each entry
names the recipe class, which recipe field lists the inputs, which input gives the tokenizer,
and the functions of the later stages as "module:attribute" targets under `moemerge` (this
module sits in the recipe layer, below them, as the merge registry does): the planner, the
router maker and the router calibrator, the model card's description, and the whole-build
runner of a kind that has no plan. Adding a kind: its recipe class, its planner, one entry
here, its modeling code if it has its own, tests and docs (docs/design.md).

The same entries say what the commands after the build do with a kind's output: `Kind.of_config`
reads a built model's config.json back to its kind (token_routed for an MoE of any transformers
layout, whoever built it; merge for a dense model), and its entry gives what finetune trains and
shards, what inspect reads, and the functions extend and extract run; a command the kind's output
does not take is refused by `Kind.refusal`, which names the kinds that take it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from moemerge.architectures.forms import layout_of
from moemerge.architectures.tables import expert_count_keys
from moemerge.errors import CheckpointError, MoemergeError, RecipeError
from moemerge.merge.registry import load_target
from moemerge.recipe.lora_experts import LoraExpertsRecipe
from moemerge.recipe.merged import MergedExpertsRecipe
from moemerge.recipe.models import MergeRecipe, MoERecipe
from moemerge.recipe.sequence import BridgedRecipe, SeqRoutedRecipe
from moemerge.recipe.shrink import ShrinkRecipe
from moemerge.recipe.stages import StagesRecipe
from moemerge.recipe.upcycle import UpcycleRecipe


@dataclass(frozen=True)
class Kind:
    name: str  # the table's key: `kind:`, or for `kind: moe` its `assembly:`
    tag: str  # the recipe union's tag: `kind:`, or `moe:<assembly>` past the default assembly
    recipe: type
    summary: str  # what the output is, for `--help`, errors and docs
    inputs: str  # the recipe field listing the merged or routed models
    planner: str | None  # "module:function"(recipe, models) -> Plan
    card: str | None  # "module:function"(recipe, plan) -> (base models, what it is, details)
    router: str | None = None  # "module:Class"(recipe, models); .make(job, load) -> router
    calibrator: str | None = None  # "module:function"(model, calibration, stats) -> {layer: W}
    # what the calibrator fits to: "module:function"(spec, texts, tokenizer, inputs)
    calibration_set: str = "routing.calibration:calibration_set"
    # (`router.init: calibrate`: fitted on the built model; stats: what `extend` refits from)
    # a kind with no plan: "module:function"(recipe, out, *, recipe_dir, recipe_text, options,
    # progress, warn) doing the whole build
    runner: str | None = None
    moe: bool = True  # the output is a Mixture-of-Experts (the card's tags)
    tunable: bool = False  # `--tune-on` can tune its merge (a merge of dense tensors)
    gguf: bool = False  # llama.cpp knows its output (`build --gguf`)
    remote_code: bool = False  # the output runs moemerge's shipped modeling code
    uniform: bool = True  # the inputs share one family, shape and vocabulary (checked on open)
    takes_moes: bool = False  # MoE checkpoints may be inputs (merged expert by expert)
    tokenizer: Callable[[object], int] = lambda recipe: 0  # the input the tokenizer comes from
    # the commands that take this kind's output (docs' support table; each refuses the others)
    commands: tuple[str, ...] = ("finetune",)

    # -- its output, as the commands after the build read it back (Kind.of_config) --
    read_back: bool = True  # False: its output reads as another kind's (upcycle, shrink, stages)
    model_type: str | None = None  # config.json's model_type where moemerge ships the class
    routing: str = "token"  # inspect routing's level: token, sequence, weight; "" for dense
    # (experts, experts used per token or sequence) from its config (a dict or a config object)
    shape: Callable[[object], tuple[int, int]] = lambda config: (0, 0)
    # "module:function"(model) -> {name: router module}, in layer order: what finetune trains
    router_modules: str = "train.params:gated_routers"
    layer_shards: bool = True  # FSDP shards each decoder layer (else one unit: see sharding.py)
    # "module:function"(reader, config, expert, label) -> Extraction: one expert as a dense model
    extract: str | None = None
    # "module:function"(reader, config, weights, label) -> Extraction: experts mixed (--weights)
    extract_mixed: str | None = None
    # "module:function"(moe, out, experts, config, **options) -> Extended: more experts
    extend: str | None = None

    def load(self, stage: str) -> Callable:
        """The function or class of `stage` ("planner", "router", ...)."""
        target = getattr(self, stage)
        if target is None:
            raise LookupError(f"kind {self.name} has no {stage}")
        return load_target(f"moemerge.{target}")

    def command(self, command: str, where: object) -> Callable:
        """The function `command` ("extract", "extract --weights", "extend") runs on this
        kind's output, or the refusal naming the kinds whose output it takes."""
        if getattr(self, TARGETS[command]) is None:
            raise self.refusal(command, where)
        return self.load(TARGETS[command])

    def require(self, command: str, where: object) -> None:
        """Refuse `command` ("bake", "route", ...) unless it takes this kind's output."""
        if command not in self.commands:
            raise self.refusal(command, where)

    def refusal(self, command: str, where: object) -> MoemergeError:
        """`where` is this kind's output, which `moemerge <command>` does not take: the wrong
        model for the command (exit 1), or for a flag of it (`extract --weights`: exit 2, as
        every flag that does not fit)."""
        takes = [kind.name for kind in OUTPUTS if (getattr(kind, TARGETS[command])
                                                    if command in TARGETS
                                                    else command in kind.commands)]
        what = self.summary.partition(" from ")[0] if self.moe else "a dense model"
        error = RecipeError if " --" in command else CheckpointError
        return error(f"{where} is {what}; `moemerge {command}` takes only "
                     f"{_listing(takes)} models")

    @staticmethod
    def of_config(config: object) -> Kind:
        """The kind whose output `config` (config.json as a dict, or a transformers config)
        describes: moemerge's own classes by model_type (seq_routed and bridged share one and
        differ in `assembly`), an MoE of a transformers layout as token_routed (whoever built
        it), any other model as merge's (dense)."""
        model_type = _value(config, "model_type")
        own = [kind for kind in OUTPUTS if kind.model_type is not None
               and kind.model_type == model_type]
        if own:
            return next((kind for kind in own if kind.name == _value(config, "assembly")),
                        own[0])
        if layout_of({"model_type": model_type}) is not None or any(
                _value(config, key) for key in expert_count_keys()):
            return BY_NAME["token_routed"]
        return BY_NAME["merge"]


# the commands that run a kind's own function: their field in the table
TARGETS = {"extract": "extract", "extract --weights": "extract_mixed", "extend": "extend"}


def _value(config: object, key: str):
    """`config[key]` of a config.json dict, or the attribute of a config object (None if not)."""
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def _listing(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _token_shape(config) -> tuple[int, int]:
    """A token-routed MoE's (experts, num_experts_per_tok); 0 for what its config lacks."""
    layout = layout_of({"model_type": _value(config, "model_type")})
    keys = (layout.num_experts_key, *layout.num_experts_aliases) if layout else ()
    experts = next((_value(config, key) for key in (*keys, *expert_count_keys())
                    if _value(config, key)), 0)
    return int(experts), int(_value(config, "num_experts_per_tok") or 0)


def _sequence_shape(config) -> tuple[int, int]:
    return len(_value(config, "experts")), int(_value(config, "num_experts_per_seq"))


def _merged_shape(config) -> tuple[int, int]:
    return int(_value(config, "num_experts")), int(_value(config, "num_experts"))  # all, merged


def _lora_shape(config) -> tuple[int, int]:
    return int(_value(config, "num_experts")), int(_value(config, "experts_per_token"))


KINDS = (
    Kind("merge", "merge", MergeRecipe, "one dense model merged from several", "inputs",
         "plan.build:plan_merge", "finish.card:merge_card", moe=False, tunable=True, gguf=True,
         takes_moes=True, calibrator="routing.moe_merge:refit_routers",
         calibration_set="routing.moe_merge:teacher_routing",
         commands=("finetune --full", "inspect task-vectors"),
         tokenizer=lambda recipe: recipe.tokenizer_index, routing=""),
    Kind("token_routed", "moe", MoERecipe,
         "a token-routed MoE (Mixtral / Qwen-MoE layout) from dense experts", "experts",
         "plan.build:plan_token_routed", "finish.card:token_routed_card",
         router="routing.routers:TokenRouters",
         calibrator="routing.calibrate:calibrate_token_routers", tunable=True, gguf=True,
         commands=("finetune", "extend", "extract", "shrink", "inspect routing"),
         shape=_token_shape, extract="io.moe_expert:extract_token_routed",
         extend="built.extend.command:extend_token_routed"),
    Kind("seq_routed", "moe:seq_routed", SeqRoutedRecipe,
         "a sequence-routed MoE: whole expert models, one router per sequence", "experts",
         "plan.sequence:plan_seq_routed", "finish.card:seq_routed_card",
         router="routing.routers:SequenceRouters",
         calibrator="routing.calibrate:calibrate_sequence_routers", remote_code=True,
         commands=("finetune", "extend", "extract", "route", "inspect routing"),
         model_type="moemerge", routing="sequence", shape=_sequence_shape,
         router_modules="train.params:sequence_router", layer_shards=False,
         extract="built.extract.seq_routed:extract_seq_routed",
         extend="built.extend.command:extend_seq_routed"),
    Kind("bridged", "moe:bridged", BridgedRecipe,
         "a sequence-routed MoE of experts of other sizes, bridged by projectors", "experts",
         "plan.sequence:plan_bridged", "finish.card:bridged_card",
         router="routing.routers:SequenceRouters",
         calibrator="routing.calibrate:calibrate_sequence_routers", remote_code=True,
         uniform=False, tokenizer=lambda recipe: recipe.tokenizer_index,
         commands=("finetune", "route", "inspect routing"),
         model_type="moemerge", routing="sequence", shape=_sequence_shape,
         router_modules="train.params:sequence_router", layer_shards=False),
    Kind("merged_experts", "moe:merged_experts", MergedExpertsRecipe,
         "a merged-experts MoE (CAMEx / SMEAR): experts merged per segment by its router",
         "experts", "plan.merged:plan_merged_experts", "finish.card:merged_experts_card",
         calibrator="routing.calibrate:calibrate_merged_routers", remote_code=True,
         commands=("finetune", "extend", "extract", "bake", "inspect routing"),
         model_type="moemerge_merged", routing="weight", shape=_merged_shape,
         router_modules="train.params:merged_routers", layer_shards=False,
         extract="built.extract.merged:extract_merged_expert",
         extract_mixed="built.extract.merged:extract_merged",
         extend="built.extend.command:extend_merged_experts"),
    Kind("lora_experts", "moe:lora_experts", LoraExpertsRecipe,
         "an MoE whose experts stay LoRA adapters of one base, mixed per token", "experts",
         "plan.lora_experts:plan_lora_experts", "finish.card:lora_experts_card",
         router="routing.routers:LoraRouters",
         calibrator="routing.calibrate:calibrate_lora_routers", remote_code=True,
         commands=("finetune", "extract", "extract --lora stored", "inspect routing"),
         model_type="moemerge_lora", shape=_lora_shape,
         router_modules="train.params:listed_routers",
         extract="built.extract.lora_experts:extract_lora_expert"),
    Kind("upcycle", "upcycle", UpcycleRecipe,
         "a token-routed MoE whose experts are copies of one dense model's FFN", "inputs",
         "plan.upcycle:plan_upcycle", "finish.card:upcycle_card",
         router="routing.routers:UpcycleRouters", gguf=True,
         commands=("finetune", "extract", "shrink", "inspect routing"), read_back=False),
    Kind("shrink", "shrink", ShrinkRecipe, "an MoE with fewer experts per layer", "inputs",
         None, None, runner="built.shrink:run",
         commands=("finetune", "extract", "shrink", "inspect routing"), read_back=False),
    Kind("stages", "stages", StagesRecipe, "several recipes built in order, later ones reading "
         "earlier outputs (mergekit-multi)", "inputs", None, None,
         runner="stage_runner:build_stages",
         moe=False, gguf=True,  # gguf: the output stage's build converts it, if its kind can
         commands=("those of its last stage's kind",), read_back=False),
)
BY_TAG = {kind.tag: kind for kind in KINDS}
BY_NAME = {kind.name: kind for kind in KINDS}
OUTPUTS = tuple(kind for kind in KINDS if kind.read_back)  # what Kind.of_config can return
AnyRecipe = Union[tuple(kind.recipe for kind in KINDS)]  # noqa: UP007 - a union made at run time
DEFAULT_ASSEMBLY = BY_TAG["moe"].name  # `kind: moe` without `assembly:`
ASSEMBLIES = tuple(k.name for k in KINDS if k.tag.partition(":")[0] == "moe")  # kind: moe's


def kind_of(recipe) -> Kind:
    """The entry of a parsed recipe."""
    return next(kind for kind in KINDS if type(recipe) is kind.recipe)


def labelled_refs(recipe) -> list[tuple[str, object]]:
    """(label, model reference) of every model the recipe reads, in plan order: the base, the
    reference, the inputs or experts, then a shared expert's model (a repeated label gets
    `#index`)."""
    refs = []
    if getattr(recipe, "base_model", None) is not None:
        refs.append(("base", recipe.base_model))
    if getattr(recipe, "reference", None) is not None:
        refs.append(("reference", recipe.reference))
    shared = getattr(recipe, "shared_model", None)  # a shared expert from a model: last
    for ref in [*getattr(recipe, kind_of(recipe).inputs), *([shared] if shared else [])]:
        # (a model with a LoRA adapter: named after the adapter)
        label = getattr(ref, "name", None) or Path((ref.lora or ref.model).rstrip("/")).name
        taken = {lab for lab, _ in refs}
        refs.append((label if label not in taken else f"{label}#{len(refs)}", ref))
    return refs
