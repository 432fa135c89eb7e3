"""Make the router tensor of a plan's router job, whatever the recipe's kind and init.

Each kind's router maker (its `router` in recipe/kinds.py) is built once per build from the
recipe and the opened models; `make(job, load)` gives a router job's tensor in the execute loop.
`router.init: calibrate` writes a placeholder here, fitted after the write
(routing/calibration.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from moemerge.merge.primitives import zero_pad
from moemerge.plan.jobs import Job, Source
from moemerge.plan.shared_expert import shared_gate_from_prompts
from moemerge.plan.sources import SourceModel
from moemerge.recipe.base import MERGEKIT_INITS
from moemerge.recipe.kinds import kind_of
from moemerge.recipe.models import MoERecipe
from moemerge.routing.init import random_router, task_vector_router, uniform_router
from moemerge.routing.prompts import (
    embed_router_rows,
    mergekit_gate_rows,
    prompt_router_rows,
)

Load = Callable[[Source], torch.Tensor]


class TokenRouters:
    """Token routers: `make(job, load)` returns a layer's router [E, H] (or a shared expert's
    gate [1, H] from its prompts)."""

    def __init__(self, recipe: MoERecipe, models: list[SourceModel]):
        base = models[0]
        self.recipe = recipe
        self.std = recipe.router.std or base.config.get("initializer_range", 0.02)
        self._rows: torch.Tensor | None = None  # [L, E, H] for prompts / cheap_embed
        self._shared_rows: torch.Tensor | None = None  # [L, 1, H]: a shared gate from prompts
        init, kwargs = recipe.router.init, {
            "include_base": recipe.include_base_expert,
            "max_tokens": recipe.router.max_prompt_tokens,
        }
        if init == "prompts":
            self._rows = prompt_router_rows(base.path, recipe.experts,
                                            ffn_module=base.family.ffn_module, **kwargs)
        elif init == "cheap_embed":
            embed, norms = _embed_and_norms(base)
            self._rows = embed_router_rows(base.path, recipe.experts, embed, norms, **kwargs)
        elif init in MERGEKIT_INITS:  # as mergekit-moe computes them (an imported config)
            embed = _embed_and_norms(base)[0] if init == "mergekit_cheap_embed" else None
            # a prompted shared expert's gate row is computed with the experts' (as mergekit)
            shared = [recipe.shared_model] if shared_gate_from_prompts(recipe) else []
            rows = mergekit_gate_rows(base.path, [*recipe.experts, *shared], init, embed=embed,
                                      layers=base.config["num_hidden_layers"])
            if shared:
                rows, self._shared_rows = rows[:, :-1], rows[:, -1:]
            if recipe.include_base_expert:  # the base expert's row is 0, as in `prompts`
                rows = torch.cat([rows, rows.new_zeros(rows.shape[0], 1, rows.shape[2])], dim=1)
            self._rows = rows

    def make(self, job: Job, load: Load) -> torch.Tensor:
        init = self.recipe.router.init
        if job.role == "shared_gate":  # plan/shared_expert.py
            assert self._shared_rows is not None
            return self._shared_rows[job.layer]
        if init in ("random", "calibrate"):  # calibrate: a placeholder, overwritten once fitted
            return random_router(job.shape, self.std, self.recipe.seed, job.name)
        if init == "uniform":
            return uniform_router(job.shape, self.recipe.seed, job.name)
        if init == "task_vector":
            return task_vector_router(load(job.base), [load(s) for s in job.sources])
        assert self._rows is not None
        return self._rows[job.layer]


class LoraRouters:
    """Routers of an MoE of LoRA experts [E, H], one per routed block: random, uniform, a
    placeholder for calibrate, or from the experts' prompts (the mean input of the block the
    router sits in: the MLP's or the attention's, through the base)."""

    def __init__(self, recipe, models: list[SourceModel]):
        self.recipe, self.base = recipe, models[0]
        self.std = recipe.router.std or self.base.config.get("initializer_range", 0.02)
        self._rows: dict[str, torch.Tensor] = {}  # block -> [L, E, H] (prompts)

    def make(self, job: Job, load: Load) -> torch.Tensor:
        init = self.recipe.router.init
        if init in ("random", "calibrate"):  # calibrate: a placeholder, overwritten once fitted
            return random_router(job.shape, self.std, self.recipe.seed, job.name)
        if init == "uniform":
            return uniform_router(job.shape, self.recipe.seed, job.name)
        block = job.name.split(".")[3]  # model.layers.{l}.{block}.router.weight
        if block not in self._rows:
            self._rows[block] = prompt_router_rows(
                self.base.path, self.recipe.experts, include_base=False,
                max_tokens=self.recipe.router.max_prompt_tokens, ffn_module=block)
        return self._rows[block][job.layer]


class UpcycleRouters:
    """Routers of `kind: upcycle` [N·r, H], r the routed slices of a copy: random, or
    virtual_group (one random row per copy, repeated for its r slices, so a copy's slices start
    with equal logits; plan/upcycle.py)."""

    def __init__(self, recipe, models: list[SourceModel]):
        self.recipe = recipe
        self.std = recipe.router.std or models[0].config.get("initializer_range", 0.02)

    def make(self, job: Job, load: Load) -> torch.Tensor:
        recipe = self.recipe
        if recipe.router.init == "random":
            return random_router(job.shape, self.std, recipe.seed, job.name)
        rows = random_router((recipe.experts, job.shape[1]), self.std, recipe.seed, job.name)
        return rows.repeat_interleave(recipe.routed_slices, dim=0)


class SequenceRouters:
    """The sequence router [N, d_m] of seq_routed / bridged models: it reads the mean token
    embedding, so the prompts init is each expert's prompts' mean embedding (in the experts'
    average embedding, zero-padded to d_m), centred across experts, as unit rows (in the
    kept tokenizer's ids)."""

    def __init__(self, recipe, models: list[SourceModel]):
        source = models[kind_of(recipe).tokenizer(recipe)]
        self.recipe, self.tokenizer_dir = recipe, source.path
        self.std = recipe.router.std or source.config.get("initializer_range", 0.02)

    def make(self, job: Job, load: Load) -> torch.Tensor:
        if job.router_init in ("random", "calibrate"):  # calibrate: a placeholder until fitted
            return random_router(job.shape, self.std, self.recipe.seed, job.name)
        width = job.shape[1]
        embeds = [load(s).float() for s in job.sources]  # [V, d_i] each
        embed = sum(zero_pad(e, (e.shape[0], width)) for e in embeds) / len(embeds)
        return embed_router_rows(self.tokenizer_dir, self.recipe.experts, embed,
                                 [torch.ones(width)], include_base=False,
                                 max_tokens=self.recipe.router.max_prompt_tokens)[0]


def router_maker(recipe, models: list[SourceModel]) -> Callable[[Job, Load], torch.Tensor] | None:
    """The kind's router maker for this build (once, after every check), or None for a kind
    without routers."""
    kind = kind_of(recipe)
    return kind.load("router")(recipe, models).make if kind.router is not None else None


def _embed_and_norms(base: SourceModel):
    """The base's embedding [V, H] and, per layer, the weight of the norm its FFN reads through
    (the family table's `router_input_norm`; ones where there is none), for cheap_embed."""
    embed = next(n for n, r in base.roles.items() if r.role == "embed")
    layers = base.config["num_hidden_layers"]
    norm = base.family.router_input_norm
    if norm is None:
        return base.reader.read(embed), [torch.ones(base.config["hidden_size"])] * layers
    return base.reader.read(embed), [base.reader.read(f"model.layers.{layer}.{norm}")
                                     for layer in range(layers)]
