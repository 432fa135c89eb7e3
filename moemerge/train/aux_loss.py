"""The load-balancing (aux) loss coefficient when the finetune config leaves it unset.

An upcycled MoE (`kind: upcycle`) starts with N copies of one FFN and a router that has seen no
data: nothing but the balancing loss pushes tokens apart at first, and without it the copies a
random router favours early take every token and the others never train (the collapse sparse
upcycling and Drop-Upcycling guard against). Its default is Drop-Upcycling's (Nakamura et al.,
2025: transformers' Switch loss, coefficient 0.02 at top-2 of 8, as Mixtral's config), scaled by
2 / top-k: transformers' loss sums over the k chosen experts (it is k at perfect balance, and its
gradient grows with k), so 0.04 / k keeps the same push per token when granularity m makes
k = experts_per_token · m. Fine-grained m = 2, k = 4: 0.01. docs/tuning.md says more.

Everything else (BTX builds, whose experts already differ and whose routers start from prompts or
are trained router-only) keeps 0 unless the config sets it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moemerge.loading import read_recipe_copy

UPCYCLE_BALANCE = 0.04  # coefficient × top-k: Drop-Upcycling's 0.02 at top-2


def is_upcycled(model_dir: Path) -> bool:
    """Whether `moemerge build` made `model_dir` from a `kind: upcycle` recipe (its recipe copy,
    kept through finetune, says so)."""
    return read_recipe_copy(model_dir).get("kind") == "upcycle"


def default_aux_loss_coef(model: torch.nn.Module, model_dir: Path, parts: list[str]) -> float:
    """0.04 / top-k for an upcycled model whose routers train (--full or routers), else 0."""
    if not ({"all", "routers"} & set(parts)) or not is_upcycled(model_dir):
        return 0.0
    return UPCYCLE_BALANCE / model.config.num_experts_per_tok
