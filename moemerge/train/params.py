"""Which parameters train, found by module structure, and where each lives on disk. Where a
kind's routers live is its entry's `router_modules` in the table of kinds (recipe/kinds.py).

Token-routed MoE (every layout of moe.yaml): an MoE block is a module
with a `gate` (GraniteMoE: `router`; a module whose weight is [experts, hidden]) and an `experts`
child (in transformers 5 the experts are fused in memory but the router stays its own module;
transformers 4's GraniteMoE has no `experts`, so it is not found there); "routers" = every
block's gate.

Sequence-routed kinds (moemerge's seq_routed and bridged, config model_type "moemerge"): one
top-level `router` (weight [N, d_m], on the mean token embedding) routes whole sequences;
"routers" = that router, which trains only when it is learned (perplexity and task-vector
routing compute their scores, nothing in them trains). "projectors" = every `proj_in` /
`proj_out` module (d_m → d_i and back around each bridged expert); only bridged models have them.

Merged experts (config model_type "moemerge_merged", CAMEx): every FFN has its own `router`
next to its `experts`; "routers" = those, "curvature" = every `curvature` module (the Kronecker
factors), present when the model was built with curvature.

"experts" = every module named `experts` (a token-routed block's experts, fused or not; the
merged kind's FFN stacks; seq_routed's whole expert models), and GraniteMoE's input_linear /
output_linear: with "routers", Branch-Train-MiX's post-merge training of the routed parts.
"""

from __future__ import annotations

import torch

from moemerge.architectures.forms import layout_of, moe_names, name_pattern
from moemerge.architectures.tables import MoELayout, moe_layouts
from moemerge.errors import MismatchError, OutputError, RecipeError
from moemerge.recipe.kinds import Kind
from moemerge.routing.modules import router_paths

PROJECTOR_NAMES = ("proj_in", "proj_out")
# config keys of the token-routed MoEs whose forward returns a load-balancing loss (aux_loss):
# transformers' Mixtral, Qwen-MoE, OLMoE, GraniteMoE, FlexOlmo; moemerge's DeepSeek-MoE
BALANCE_KEYS = ("router_aux_loss_coef", "aux_loss_alpha")
PART_MODULES = {  # part: (module names, which models have them)
    # the routed experts: token-routed blocks' `experts` (transformers 4's GraniteMoE: its
    # input_linear / output_linear), merged_experts' FFN stacks, seq_routed's expert models
    "experts": (("experts", "input_linear", "output_linear"), "MoEs with routed experts"),
    "projectors": (PROJECTOR_NAMES, "only the projector-bridged MoE kind has them"),
    "curvature": (("curvature",), "only merged-experts models built with curvature have it"),
}


def moe_blocks(model: torch.nn.Module, router: str = "gate") -> dict[str, torch.nn.Module]:
    """{module name: block} of every MoE block: a module with `experts` and a `router` child."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, router, None), torch.nn.Module)
            and isinstance(getattr(m, "experts", None), torch.nn.Module)}


def router_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{name: router module} in layer order; the routers' weights are [experts, hidden]."""
    return Kind.of_config(model.config).load("router_modules")(model)


def gated_routers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Token-routed (and any model not known to be another kind): the router is the child of
    an MoE block next to `experts` that a moe.yaml layout's `router` names (`gate`: Mixtral,
    Qwen MoEs, FlexOlmo; `router`: GraniteMoE); none in a dense model."""
    for attr in dict.fromkeys(path[0] for layout in moe_layouts().values()
                              for path in router_paths(layout)):
        blocks = moe_blocks(model, attr)
        if blocks:
            return {f"{name}.{attr}": getattr(block, attr) for name, block in blocks.items()}
    return {}


def sequence_router(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {"router": model.router}


def merged_routers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """One router per FFN."""
    return {f"{name}.router": b.router for name, b in moe_blocks(model, "router").items()}


def listed_routers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """A shipped class that lists its own (LoRA experts: one router per adapted module)."""
    return model.router_modules()


def learned_routing(model: torch.nn.Module) -> bool:
    """False for a sequence-routed model routed by perplexity or task vectors: its router has
    nothing to train, and a training step can leave trainable parameters without a gradient
    (the unused router weights, a kept base, experts no sequence went to)."""
    return Kind.of_config(model.config).routing != "sequence" or \
        model.config.router == "learned"


def _check_router_trains(model: torch.nn.Module, where: str) -> None:
    if not learned_routing(model):
        raise RecipeError(
            f"training routers (--router-only, the default): {where} routes sequences by "
            f"{model.config.router}, which has no weights to train. Rebuild it with `router: "
            "{kind: learned}` in the recipe, or load it with router='learned' (set \"router\": "
            "\"learned\" in a copy's config.json; its router.weight is there, randomly "
            "initialised), or train other parts (--train projectors, --full)")


def _part_prefixes(model: torch.nn.Module, part: str, where: str) -> list[str]:
    names, owners = PART_MODULES[part]
    found = [n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] in names]
    if not found:
        raise RecipeError(f"--train {part}: model {where} has no {part} ({owners}); train "
                          "routers or --full")
    return [f"{name}." for name in found]


def select_trainable(model: torch.nn.Module, parts: list[str], where: str) -> list[str]:
    """Set requires_grad on the chosen parts only; return their parameter names.

    Frozen parameters get no gradient and no optimizer state. 'all' is every parameter, also
    those the loss cannot reach (a non-learned router, a kept base: AdamW leaves them as they
    are; the task-vector router needs the base's requires_grad to score)."""
    routers = router_modules(model)
    if not routers and parts != ["all"]:
        raise MismatchError(
            f"{where} is not an MoE: no MoE block with a router (a `gate` or `router` next to "
            f"`experts`) in {type(model).__name__}, so it has no {', '.join(parts)} to train. "
            f"finetune trains parts of MoE models such as those `moemerge build` makes ("
            f"{moe_names()}, seq_routed, bridged, merged_experts, lora_experts); a dense model "
            "trains whole with --full (e.g. the compute-matched control of an MoE).")
    prefixes = []
    if "routers" in parts:
        _check_router_trains(model, where)
        prefixes += [f"{name}." for name in routers]
    for part in PART_MODULES:
        if part in parts:
            prefixes += _part_prefixes(model, part, where)
    names = [n for n, _ in model.named_parameters()
             if "all" in parts or any(n.startswith(p) for p in prefixes)]
    chosen = set(names)
    for name, param in model.named_parameters():
        param.requires_grad_(name in chosen)
    return names


def check_aux_loss(model: torch.nn.Module, coef: float, where: str) -> None:
    """--aux-loss-coef needs router logits to balance: refused for routing that is not learned
    (the model returns no aux_loss), rather than silently training without it."""
    routing = Kind.of_config(model.config).routing
    if coef > 0 and not router_modules(model):
        raise RecipeError(f"--aux-loss-coef {coef}: {where} is dense; there is no router to "
                          "balance; leave it at 0")
    if coef > 0 and routing == "weight":
        raise RecipeError(f"--aux-loss-coef {coef}: {where} merges every expert per segment; "
                          "there is no top-k load to balance; leave it at 0")
    if coef > 0 and not learned_routing(model):
        raise RecipeError(f"--aux-loss-coef {coef}: {where} routes sequences by "
                          f"{model.config.router}, which has no router logits to balance; "
                          "leave it at 0")
    if coef > 0 and routing == "token" and not any(
            hasattr(model.config, key) for key in BALANCE_KEYS):
        why = (" (transformers' DeepSeek-V2 / V3 train without one; V3 balances its experts "
               "with a per-expert routing bias, e_score_correction_bias, which finetune keeps "
               "as it is)" if "deepseek" in str(getattr(model.config, "model_type", "")) else "")
        raise RecipeError(f"--aux-loss-coef {coef}: {where}: {type(model).__name__} returns no "
                          f"load-balancing loss{why}; leave it at 0")


def to_disk_names(model: torch.nn.Module, tensors: dict[str, torch.Tensor],
                  disk: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                  config: dict | None = None) -> dict[str, torch.Tensor]:
    """In-memory parameters → the checkpoint's own tensor names, through transformers' reverse
    of its load-time conversion (block_sparse_moe → mlp renames; per-expert w1/w3 → fused
    gate_up_proj [E, 2I, H], gate rows first; w2 → down_proj [E, H, I]). `disk` holds the
    classic names (io.reader's view of either form): a checkpoint stored in transformers 5's
    fused form loads with no conversion, so the in-memory names are its fused ones, which
    `config` (the source's config.json) maps to the classic names through moe.yaml's
    `fused_form`. Every result must be a tensor of the source checkpoint with its shape; a tied
    weight the source does not store is left out."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: no conversion, in-memory names are the disk names
        mapped = dict(tensors)
    else:
        mapped = revert_weight_conversion(model, dict(tensors))
    if config is not None and (layout := layout_of(config)) is not None:
        mapped = _classic_names(layout, mapped, disk)
    tied = _tied_names(model)
    out = {}
    for name, tensor in mapped.items():
        if name not in disk:
            if name in tied:
                continue
            raise OutputError(f"trained tensor {name!r} has no counterpart in the source "
                              "checkpoint; cannot write it in the source's layout")
        if tuple(tensor.shape) != disk[name][1]:
            raise OutputError(f"trained tensor {name!r} is {list(tensor.shape)} but the source "
                              f"stores {list(disk[name][1])}")
        out[name] = tensor
    return out


def _tied_names(model: torch.nn.Module) -> set[str]:
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    return {"lm_head.weight"}


def _classic_names(layout: MoELayout, tensors: dict[str, torch.Tensor],
                   disk: dict[str, tuple[torch.dtype, tuple[int, ...]]]
                   ) -> dict[str, torch.Tensor]:
    """Fused-form names (moe.yaml's `fused_form`) the source does not hold under them → its
    classic names: a renamed tensor (Mixtral's mlp.gate, GraniteMoE's stacks) renamed, a stack
    [E, rows, cols] split into each expert's projections (rows in the listed order)."""
    patterns = {t: name_pattern(t) for t in layout.fused_form}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        found = None if name in disk else next(
            ((t, m) for t, p in patterns.items() if (m := p.fullmatch(name))), None)
        if found is None:
            out[name] = tensor
            continue
        template, match = found
        layer, target = int(match["layer"]), layout.fused_form[template]
        if isinstance(target, str):
            out[target.format(layer=layer)] = tensor
            continue
        for expert, block in enumerate(tensor):
            for proj, part in zip(target, block.chunk(len(target)), strict=True):
                out[layout.expert_name(layer, expert, proj)] = part
    return out
