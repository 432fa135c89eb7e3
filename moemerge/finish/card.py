"""The model card (README.md) written next to a built checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from moemerge import __version__
from moemerge.finish.remote_code import load_call, needs_remote_code
from moemerge.io.resolve import looks_like_path
from moemerge.plan.jobs import Plan
from moemerge.recipe.kinds import kind_of
from moemerge.recipe.merged import MergedExpertsRecipe
from moemerge.recipe.models import MergeRecipe, MoERecipe
from moemerge.recipe.sequence import BridgedRecipe, SeqRoutedRecipe
from moemerge.recipe.upcycle import UpcycleRecipe
from moemerge.words import plural


def seq_routed_card(recipe: SeqRoutedRecipe, plan: Plan):
    return _sequence_card(recipe, plan,
                          "sequence-routed Mixture-of-Experts with separate attention")


def bridged_card(recipe: BridgedRecipe, plan: Plan):
    return _sequence_card(recipe, plan, "projector-bridged heterogeneous Mixture-of-Experts")


def _sequence_card(recipe: SeqRoutedRecipe | BridgedRecipe, plan: Plan, kind: str):
    config = plan.config
    widths = [e["hidden_size"] for e in config["experts"]]
    bases = [*([recipe.base_model.model] if getattr(recipe, "base_model", None) else []),
             *(e.model for e in recipe.experts)]
    what = (f"a {kind} with {plural(len(recipe.experts), 'expert')}, "
            f"{recipe.experts_per_sequence} per sequence, routed by `{recipe.router.kind}` "
            f"routing, mixing `{recipe.mix}`")
    details = [
        "| expert | name | from | hidden size | layers |", "|---|---|---|---|---|",
        *(f"| {i} | {name} | `{e.model}` | {w} | {c['num_hidden_layers']} |"
          for i, (name, e, w, c) in enumerate(zip(config["expert_names"], recipe.experts, widths,
                                                  config["experts"], strict=True))),
        "", "Override the routing at load time, e.g. `router=\"perplexity\"`.",
        *(f"\n**Note:** {note}" for note in plan.notes),  # e.g. a bridged vocabulary map
    ]
    return bases, what, details


def merged_experts_card(recipe: MergedExpertsRecipe, plan: Plan):
    bases = [recipe.base_model.model, *(e.model for e in recipe.experts)]
    curvature = (f"Kronecker curvature of rank {recipe.curvature.rank}"
                 if recipe.curvature.kind == "kronecker" else "no curvature (SMEAR / Lory)")
    what = (f"a merged-experts MoE: every FFN is, per segment of {recipe.segment_length} tokens, "
            f"the router-weighted merge of the FFNs of {plural(len(recipe.experts), 'expert')} "
            f"around `{(recipe.reference or recipe.base_model).model}`, with {curvature}, mask "
            f"`{recipe.mask.kind}`, α = {recipe.alpha:g}" + (", dynamic" if recipe.dynamic else ""))
    details = ["| expert | name | FFN from |", "|---|---|---|",
               *(f"| {i} | {e.name or ''} | `{e.model}` |" for i, e in enumerate(recipe.experts))]
    return bases, what, details


def lora_experts_card(recipe, plan: Plan):
    ranks = sorted(set(plan.config["lora_ranks"].values()))
    mixed = ("a dense mixture of every adapter" if recipe.top_k == recipe.num_experts
             else f"the top {recipe.top_k} per token")
    what = (f"an MoE of {plural(recipe.num_experts, 'LoRA expert')} on one copy of "
            f"`{recipe.base_model.model}`: each targeted linear module adds its adapters' "
            f"low-rank deltas, {mixed} by the router of its block "
            f"({plural(len(plan.config['lora_ranks']), 'module')}, stored rank "
            f"{'/'.join(map(str, ranks)) or '-'})")
    details = ["| expert | name | adapter |", "|---|---|---|",
               *(f"| {i} | {label} | `{e.lora}` |" for i, (label, e) in
                 enumerate(zip(plan.labels[1:], recipe.experts, strict=True)))]
    return [recipe.base_model.model], what, details


def upcycle_card(recipe: UpcycleRecipe, plan: Plan):
    what = (f"a token-routed Mixture-of-Experts ({plan.config['architectures'][0]}) upcycled "
            f"from the dense `{recipe.model.model}`: {plural(recipe.experts, 'copy', 'copies')} "
            "of its FFN, each "
            f"split into {plural(recipe.granularity, 'slice')} "
            f"({plural(recipe.num_experts, 'expert')}, "
            f"{recipe.top_k} per token"
            + (f"; {plural(recipe.shared_experts, 'slice')} of the dense FFN always on as the "
               "shared expert" if recipe.shared_experts else "") + ")")
    details = [f"Router init `{recipe.router.init}`; Drop-Upcycling re-initialisation ratio "
               f"{recipe.reinit.ratio:g}; noise std {recipe.noise:g}."]
    return [recipe.model.model], what, details


def token_routed_card(recipe: MoERecipe, plan: Plan):
    bases = [recipe.base_model.model, *(e.model for e in recipe.experts)]
    experts = [(e.name or "", e.model) for e in recipe.experts]
    if recipe.include_base_expert:
        experts.append(("base", recipe.base_model.model))
    what = (
        f"a token-routed Mixture-of-Experts ({plan.config['architectures'][0]}) with "
        f"{plural(len(experts), 'expert')}, {recipe.top_k} per token, built from dense "
        f"experts branched from `{recipe.base_model.model}`"
    )
    details = [
        "| expert | name | FFN from |", "|---|---|---|",
        *(f"| {i} | {name} | `{model}` |" for i, (name, model) in enumerate(experts)),
        "",
        f"Non-FFN tensors merged with `{recipe.merge.method}`; router init "
        f"`{recipe.router.init}`"
        + (f"; shared expert: {_shared_text(recipe)}." if recipe.shared_expert != "none"
           else "."),
        *(f"\n**Note:** {note}" for note in plan.notes),
    ]
    return bases, what, details


def _shared_text(recipe: MoERecipe) -> str:
    shared = recipe.shared_model
    if shared is not None:
        return f"the FFN of `{shared.model}`"
    return "the base's FFN" if recipe.shared_expert == "base" else "the experts' FFN average"


def merge_card(recipe: MergeRecipe, plan: Plan):
    refs = ([recipe.base_model] if recipe.base_model else []) + recipe.inputs
    bases = [m.model for m in refs]
    what = f"a dense `{recipe.merge.method}` merge of {plural(len(recipe.inputs), 'model')}"
    details = ["| model | weight |", "|---|---|",
               *(f"| {m.model} | {_setting_text(m.weight)} |" for m in recipe.models)]
    if recipe.slices:
        what += f", {plural(len(recipe.slices), 'slice')} of their layers stacked"
        details = ["| slice | sources (layers [start, end)) |", "|---|---|",
                   *(f"| {i} | " + ", ".join(f"{s.model} {list(s.layers)}" for s in sl.sources)
                     + " |" for i, sl in enumerate(recipe.slices))]
    aligned = next((job.vocab for job in plan.jobs if job.vocab is not None), None)
    if aligned is not None:  # a merged vocabulary (plan/tokens.py)
        details += ["", f"Vocabulary (`tokenizer: {recipe.tokenizer.source}`): embedding and "
                        f"head {aligned.describe()}."]
    return bases, what, details


def model_card(recipe, plan: Plan, recipe_text: str, recipe_dir: Path | None = None) -> str:
    """The card of any kind: its entry's `card` says what the model is (bases, one sentence,
    detail lines); the front matter, loading, sizes and the recipe are the same for all.
    `base_model` lists the hub ids among the bases only: a local directory (relative ones are
    read next to the recipe, `recipe_dir`) means nothing on the hub; the card's text names
    it."""
    kind = kind_of(recipe)
    bases, what, details = kind.load("card")(recipe, plan)
    near = (recipe_dir,) if recipe_dir is not None else ()
    hub = [b for b in dict.fromkeys(bases) if not looks_like_path(b, near)]
    front = yaml.safe_dump(
        {**({"base_model": hub} if hub else {}), "library_name": "transformers",
         "tags": ["moemerge", "merge", *(["moe"] if kind.moe else [])]},
        sort_keys=False,
    )
    size = sum(j.nbytes for j in plan.jobs) / 2**20
    loading = ([f"Load it with `{load_call('path')}`: its modeling code (the `.py` files next "
                "to the weights) is a copy of moemerge's own, nothing from the input models.",
                ""] if needs_remote_code(plan.config) else [])
    return "\n".join([
        "---", front.rstrip(), "---", "",
        f"# {recipe.name or 'moemerge model'}", "",
        f"This model is {what}. Made with moemerge {__version__}.", "",
        *loading,
        *details, "",
        f"{plural(len(plan.jobs), 'tensor')}, {size:,.1f} MiB.", "",
        "## Recipe", "", "```yaml", recipe_text.rstrip(), "```", "",
    ])


def _setting_text(setting: object) -> str:
    """A model's weight as the recipe gives it: a number, a gradient, or its conditions."""
    if isinstance(setting, float | int):
        return f"{setting:g}"
    return json.dumps(setting if not hasattr(setting[0], "model_dump") else [
        c.model_dump(exclude_none=True) for c in setting]).replace("|", "\\|")
