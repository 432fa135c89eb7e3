"""Which parameters train, found by module structure, and where each lives on disk.

An MoE block is a module with a `gate` (the router: a module whose weight is [experts, hidden])
and `experts` child, as in transformers' Mixtral, Qwen2-MoE and Qwen3-MoE (in transformers 5 the
experts are fused in memory but the router stays its own module). Projectors are modules named
`proj_in` / `proj_out` (the bridged MoE kind); no model moemerge builds today has them.
"""

from __future__ import annotations

import torch

from moemerge.errors import MismatchError, OutputError, RecipeError

PROJECTOR_NAMES = ("proj_in", "proj_out")


def moe_blocks(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{module name: block} of every MoE block with a router."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "gate", None), torch.nn.Module)
            and isinstance(getattr(m, "experts", None), torch.nn.Module)}


def router_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{name: router module} in layer order; the routers' weights are [experts, hidden]."""
    return {f"{name}.gate": block.gate for name, block in moe_blocks(model).items()}


def select_trainable(model: torch.nn.Module, parts: list[str], where: str) -> list[str]:
    """Set requires_grad on the chosen parts only; return their parameter names.

    Frozen parameters get no gradient and no optimizer state."""
    routers = router_modules(model)
    if not routers:
        raise MismatchError(
            f"{where} is not an MoE: no MoE block with a router (a `gate` next to `experts`) "
            f"in {type(model).__name__}, so there is no router to train. finetune trains MoE "
            "models such as those `moemerge build` makes (Mixtral, Qwen2-MoE, Qwen3-MoE).")
    chosen: set[str] = set()
    prefixes = []
    if "all" in parts:
        chosen = {n for n, _ in model.named_parameters()}
    if "routers" in parts:
        prefixes += [f"{name}." for name in routers]
    if "projectors" in parts:
        found = [n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTOR_NAMES]
        if not found:
            raise RecipeError(f"--train projectors: model {where} has no projectors (only the "
                              "projector-bridged MoE kind has them); train routers or --full")
        prefixes += [f"{name}." for name in found]
    for name, _ in model.named_parameters():
        if any(name.startswith(p) for p in prefixes):
            chosen.add(name)
    for name, param in model.named_parameters():
        param.requires_grad_(name in chosen)
    return [n for n, _ in model.named_parameters() if n in chosen]


def to_disk_names(model: torch.nn.Module, tensors: dict[str, torch.Tensor],
                  disk: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """In-memory parameters → the checkpoint's own tensor names, through transformers' reverse
    of its load-time conversion (block_sparse_moe → mlp renames; per-expert w1/w3 → fused
    gate_up_proj [E, 2I, H], gate rows first; w2 → down_proj [E, H, I]). Every result must be a
    tensor of the source checkpoint with its shape; a tied weight the source does not store is
    left out."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: no conversion, in-memory names are the disk names
        mapped = dict(tensors)
    else:
        mapped = revert_weight_conversion(model, dict(tensors))
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
