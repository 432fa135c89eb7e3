"""Make the router tensor of a plan's router job, whatever the recipe's kind and init."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from moemerge.merge.primitives import zero_pad
from moemerge.plan.jobs import Job, Source
from moemerge.recipe.models import MoERecipe
from moemerge.routing.init import random_router, task_vector_router
from moemerge.routing.prompts import embed_router_rows, prompt_router_rows

Load = Callable[[Source], torch.Tensor]


class RouterFactory:
    """Token routers: built once per build; `make(job, load)` returns a layer's router [E, H]."""

    def __init__(self, recipe: MoERecipe, base_dir: Path, base_config: dict, load_base: Callable,
                 *, ffn_module: str = "mlp"):
        self.recipe = recipe
        self.std = recipe.router.std or base_config.get("initializer_range", 0.02)
        self._rows: torch.Tensor | None = None  # [L, E, H] for prompts / cheap_embed
        init, kwargs = recipe.router.init, {
            "include_base": recipe.include_base_expert,
            "max_tokens": recipe.router.max_prompt_tokens,
        }
        if init == "prompts":
            self._rows = prompt_router_rows(base_dir, recipe.experts, ffn_module=ffn_module,
                                            **kwargs)
        elif init == "cheap_embed":
            embed, norms = load_base()
            self._rows = embed_router_rows(base_dir, recipe.experts, embed, norms, **kwargs)

    def make(self, job: Job, load: Load) -> torch.Tensor:
        init = self.recipe.router.init
        if init in ("random", "calibrate"):  # calibrate: a placeholder, overwritten once fitted
            return random_router(job.shape, self.std, self.recipe.seed, job.output)
        if init == "task_vector":
            return task_vector_router(load(job.base), [load(s) for s in job.sources])
        assert self._rows is not None
        return self._rows[job.layer]


class UpcycleRouterFactory:
    """Routers of `kind: upcycle` [N·m, H]: random, or virtual_group (one random row per copy,
    repeated for its m slices, so a copy's slices start with equal logits; plan/upcycle.py)."""

    def __init__(self, recipe, config: dict):
        self.recipe = recipe
        self.std = recipe.router.std or config.get("initializer_range", 0.02)

    def make(self, job: Job, load: Load) -> torch.Tensor:
        recipe = self.recipe
        if recipe.router.init == "random":
            return random_router(job.shape, self.std, recipe.seed, job.output)
        rows = random_router((recipe.experts, job.shape[1]), self.std, recipe.seed, job.output)
        return rows.repeat_interleave(recipe.granularity, dim=0)


class SequenceRouterFactory:
    """The sequence router [N, d_m] of seq_routed / bridged models: it reads the mean token
    embedding, so the prompts init is each expert's prompts' mean embedding (in the experts'
    average embedding, zero-padded to d_m), centred across experts, as unit rows."""

    def __init__(self, recipe, tokenizer_dir: Path, config: dict):
        self.recipe, self.tokenizer_dir = recipe, tokenizer_dir
        self.std = recipe.router.std or config.get("initializer_range", 0.02)

    def make(self, job: Job, load: Load) -> torch.Tensor:
        if job.router_init == "random":
            return random_router(job.shape, self.std, self.recipe.seed, job.output)
        width = job.shape[1]
        embeds = [load(s).float() for s in job.sources]  # [V, d_i] each
        embed = sum(zero_pad(e, (e.shape[0], width)) for e in embeds) / len(embeds)
        return embed_router_rows(self.tokenizer_dir, self.recipe.experts, embed,
                                 [torch.ones(width)], include_base=False,
                                 max_tokens=self.recipe.router.max_prompt_tokens)[0]
