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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Union

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

    def load(self, stage: str) -> Callable:
        """The function or class of `stage` ("planner", "router", ...)."""
        target = getattr(self, stage)
        if target is None:
            raise LookupError(f"kind {self.name} has no {stage}")
        return load_target(f"moemerge.{target}")


KINDS = (
    Kind("merge", "merge", MergeRecipe, "one dense model merged from several", "inputs",
         "plan.build:plan_merge", "finish.card:merge_card", moe=False, tunable=True, gguf=True,
         takes_moes=True, calibrator="routing.moe_merge:refit_routers",
         calibration_set="routing.moe_merge:teacher_routing",
         commands=("finetune --full", "inspect task-vectors"),
         tokenizer=lambda recipe: recipe.tokenizer_index),
    Kind("token_routed", "moe", MoERecipe,
         "a token-routed MoE (Mixtral / Qwen-MoE layout) from dense experts", "experts",
         "plan.build:plan_token_routed", "finish.card:token_routed_card",
         router="routing.routers:TokenRouters",
         calibrator="routing.calibrate:calibrate_token_routers", tunable=True, gguf=True,
         commands=("finetune", "extend", "extract", "shrink", "inspect routing")),
    Kind("seq_routed", "moe:seq_routed", SeqRoutedRecipe,
         "a sequence-routed MoE: whole expert models, one router per sequence", "experts",
         "plan.sequence:plan_seq_routed", "finish.card:seq_routed_card",
         router="routing.routers:SequenceRouters",
         calibrator="routing.calibrate:calibrate_sequence_routers", remote_code=True,
         commands=("finetune", "extend", "extract", "route", "inspect routing")),
    Kind("bridged", "moe:bridged", BridgedRecipe,
         "a sequence-routed MoE of experts of other sizes, bridged by projectors", "experts",
         "plan.sequence:plan_bridged", "finish.card:bridged_card",
         router="routing.routers:SequenceRouters",
         calibrator="routing.calibrate:calibrate_sequence_routers", remote_code=True,
         uniform=False, tokenizer=lambda recipe: recipe.tokenizer_index,
         commands=("finetune", "route", "inspect routing")),
    Kind("merged_experts", "moe:merged_experts", MergedExpertsRecipe,
         "a merged-experts MoE (CAMEx / SMEAR): experts merged per segment by its router",
         "experts", "plan.merged:plan_merged_experts", "finish.card:merged_experts_card",
         calibrator="routing.calibrate:calibrate_merged_routers", remote_code=True,
         commands=("finetune", "extend", "extract", "bake", "inspect routing")),
    Kind("lora_experts", "moe:lora_experts", LoraExpertsRecipe,
         "an MoE whose experts stay LoRA adapters of one base, mixed per token", "experts",
         "plan.lora_experts:plan_lora_experts", "finish.card:lora_experts_card",
         router="routing.routers:LoraRouters",
         calibrator="routing.calibrate:calibrate_lora_routers", remote_code=True,
         commands=("finetune", "extract", "inspect routing")),
    Kind("upcycle", "upcycle", UpcycleRecipe,
         "a token-routed MoE whose experts are copies of one dense model's FFN", "inputs",
         "plan.upcycle:plan_upcycle", "finish.card:upcycle_card",
         router="routing.routers:UpcycleRouters", gguf=True,
         commands=("finetune", "extract", "shrink", "inspect routing")),
    Kind("shrink", "shrink", ShrinkRecipe, "an MoE with fewer experts per layer", "inputs",
         None, None, runner="built.shrink:run",
         commands=("finetune", "extract", "shrink", "inspect routing")),
    Kind("stages", "stages", StagesRecipe, "several recipes built in order, later ones reading "
         "earlier outputs (mergekit-multi)", "inputs", None, None,
         runner="stage_runner:build_stages",
         moe=False, gguf=True,  # gguf: the output stage's build converts it, if its kind can
         commands=("those of its last stage's kind",)),
)
BY_TAG = {kind.tag: kind for kind in KINDS}
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
