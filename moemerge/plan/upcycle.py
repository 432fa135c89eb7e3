"""Plan of `kind: upcycle`: one dense model's FFN copied into N experts, each split m ways.

Why it starts exactly at the dense model (docs/recipes.md, `kind: upcycle`). Split the FFN's I
intermediate units into m slices S_j of I/m units: gate/up keep rows S_j, down keeps columns S_j,
and FFN(x) = down(act(gate x) * up x) = Σ_j FFN_j(x), since the units do not interact. Copy c,
slice j becomes expert c·m + j. When the router gives the m slices of a copy identical logits
(`virtual_group`), softmax gives each slice of copy c the probability P_c / m and top-(k·m) takes
whole copies (ties within a group are equal, so a group is never split), and renormalising over
the chosen slices gives each slice of copy c the weight w_c / m with Σ_c w_c = 1 over the k
chosen copies. The layer then returns Σ_c (w_c / m) Σ_j FFN_j(x) = FFN(x) / m, so every down
slice is scaled by m and the output is the dense FFN. For m = 1 any router does (Σ_c w_c = 1).

With `shared_experts: s` (DeepSeekMoE's shared expert isolation; a DeepSeek-MoE output) the
first s slices of the dense FFN are the always-on shared expert, once, unchanged, and each copy
keeps slices s..m-1 as its r = m - s routed experts (copy c, slice j is expert c·r + j - s): the
same argument with r for m gives the routed part Σ_{j >= s} FFN_j(x) (each down slice scaled by
r), and the shared one adds Σ_{j < s} FFN_j(x): the dense FFN again.

Each expert tensor is a copy job of the dense FFN tensor with a change, `UpcycledSlice`, made in
the execute loop: copy c of the dense tensor (Drop-Upcycling re-initialisation, then noise,
drawn from generators of (seed, tensor name): the same recipe gives the same bytes), slice j of
it. `--dry-run` shows each as such.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moemerge.architectures.config import moe_config
from moemerge.errors import RecipeError
from moemerge.merge.primitives import generator_for
from moemerge.plan.build import refuse_unsupported_tensors
from moemerge.plan.common import output_dtype, stored_layout, write_order
from moemerge.plan.fused import fuse_jobs
from moemerge.plan.jobs import Job, Plan, Source
from moemerge.plan.shared_expert import downstream_notes, zeroed_shared_expert
from moemerge.plan.sources import SourceModel
from moemerge.recipe.upcycle import UpcycleRecipe


class UpcycleCopies:
    """The copies of one dense model's FFN tensors, shared by the slices made from them: a plan
    takes the m slices of each of the N copies of one dense tensor in a row, so each copy is
    made once (the last one is kept, float32)."""

    def __init__(self, recipe: UpcycleRecipe, dense: SourceModel):
        self.recipe, self.config = recipe, dense.config
        intermediate, m = dense.config["intermediate_size"], recipe.granularity
        if intermediate % m:
            raise RecipeError(f"granularity: {m} does not divide the dense model's "
                              f"intermediate_size {intermediate}; each expert would not be a "
                              "whole number of units")
        self.width = intermediate // m
        self._dense: tuple[str, torch.Tensor] | None = None  # the last dense tensor, float32
        self._cache: tuple[tuple[str, int], torch.Tensor] | None = None  # and its last copy
        self._lock = threading.Lock()

    def resident_bytes(self, largest: int) -> int:
        """What the copies hold at most beyond the slices returned, for a dense FFN tensor of
        `largest` elements, measured (tests/integration/test_memory_bound.py): the float32 dense
        tensor and its copy, the allocator's arenas of the reader thread that slices them (two
        more float32 tensors: the unchanged copy measured up to 93 MiB over the estimate
        without them, with L of 24 MiB), and when the copy is changed (reinit, noise) its
        random draws and the clone they change, whose freed pages the allocator may keep: 8
        tensors (6 measured up to 347 MiB against an estimate of 264 + 64 slack, once in CI)."""
        changed = self.recipe.reinit.ratio > 0 or self.recipe.noise > 0
        return 4 * largest * (8 if changed else 4)

    def slice(self, read: Callable[[], torch.Tensor], part: UpcycledSlice) -> torch.Tensor:
        """Slice `part` of its copy; `read()` reads the dense tensor when it is not held (once
        per dense tensor: its N copies and their m slices come in a row)."""
        with self._lock:
            key = (part.dense, part.copy)
            if self._cache is None or self._cache[0] != key:
                self._cache = None  # freed before the next copy is made: one copy at a time
                if self._dense is None or self._dense[0] != part.dense:
                    self._dense = None  # the previous dense tensor is freed first
                    self._dense = (part.dense, read().float())
                self._cache = (key, self._copy(self._dense[1], part))
            full = self._cache[1]
        units = slice(part.slice * self.width, (part.slice + 1) * self.width)
        if part.proj == "down":  # ×r: the r routed slices of a copy share its router weight
            return (full[:, units] * self.recipe.routed_slices).contiguous()
        return full[units].clone()  # its own memory: never a view of the cached copy

    def _copy(self, weight: torch.Tensor, part: UpcycledSlice) -> torch.Tensor:
        """Copy `part.copy` of one dense FFN tensor [float32]: re-initialised units, then
        noise."""
        dense = weight  # never modified in place: the next copy starts from it
        axis = 1 if part.proj == "down" else 0  # the intermediate units' axis
        units = self.reinit_units(part.layer, part.copy)
        if len(units) or self.recipe.noise > 0:
            weight = weight.clone()  # then changed in place: one float32 tensor at a time
        if len(units):
            shape = list(weight.shape)
            shape[axis] = len(units)
            fresh = torch.randn(shape, generator=generator_for(
                self.reinit_seed, f"{part.dense} copy {part.copy} reinit"))
            weight.index_copy_(axis, units, fresh.mul_(dense.std()).add_(dense.mean()))
        if self.recipe.noise > 0:
            weight.add_(torch.randn(weight.shape, generator=generator_for(
                self.recipe.seed, f"{part.dense} copy {part.copy} noise")).mul_(self.recipe.noise))
        return weight

    @property
    def reinit_seed(self) -> int:
        seed = self.recipe.reinit.seed
        return self.recipe.seed if seed is None else seed

    def reinit_units(self, layer: int, copy: int) -> torch.Tensor:
        """The intermediate units copy `copy` of layer `layer` re-draws (the same for its gate,
        up and down): round(ratio · I) of them, chosen at random."""
        total = self.config["intermediate_size"]
        count = round(self.recipe.reinit.ratio * total)
        if count == 0:
            return torch.empty(0, dtype=torch.long)
        order = torch.randperm(total, generator=generator_for(
            self.reinit_seed, f"model.layers.{layer} copy {copy} reinit units"))
        return order[:count].sort().values


@dataclass(frozen=True)
class UpcycledSlice:
    """Slice `slice` of copy `copy` of the dense FFN tensor `dense` (a Source's change)."""

    copies: UpcycleCopies
    dense: str
    proj: str  # gate / up / down
    layer: int
    copy: int
    slice: int

    def apply(self, read: Callable[[], torch.Tensor]) -> torch.Tensor:
        return self.copies.slice(read, self)

    def describe(self) -> str:
        recipe = self.copies.recipe
        changed = [f"{recipe.reinit.ratio:g} re-initialised"] if recipe.reinit.ratio else []
        changed += [f"noise std {recipe.noise:g}"] if recipe.noise else []
        return (f"copy {self.copy}" + (f" ({', '.join(changed)})" if changed else "")
                + f", slice {self.slice + 1}/{recipe.granularity}"
                + (f" ×{recipe.routed_slices}" if self.proj == "down" and
                   recipe.routed_slices > 1 else ""))

    def dtype(self, stored: torch.dtype) -> torch.dtype:
        return torch.float32  # copies are made in float32

    def shape(self, stored: tuple[int, ...]) -> tuple[int, int]:
        rows, cols = stored
        width = self.copies.width
        return (rows, width) if self.proj == "down" else (width, cols)


@dataclass(frozen=True)
class DenseUnits:
    """Intermediate units [first, end) of a dense FFN tensor, unchanged (the shared expert of
    an upcycle with shared_experts; a Source's change)."""

    proj: str
    first: int
    end: int

    def apply(self, read: Callable[[], torch.Tensor]) -> torch.Tensor:
        weight = read()
        units = slice(self.first, self.end)
        return (weight[:, units] if self.proj == "down" else weight[units]).contiguous()

    def describe(self) -> str:
        return f"units {self.first}..{self.end - 1} (the shared expert)"

    def dtype(self, stored: torch.dtype) -> torch.dtype:
        return stored

    def shape(self, stored: tuple[int, ...]) -> tuple[int, int]:
        rows, cols = stored
        width = self.end - self.first
        return (rows, width) if self.proj == "down" else (width, cols)


def plan_upcycle(recipe: UpcycleRecipe, models: list[SourceModel]) -> Plan:
    """models = [dense]: non-FFN tensors copied from the dense model, a router per layer, and
    experts c·r + j - s = slice j (>= s) of copy c of its FFN (its first s slices the shared
    expert)."""
    dense = models[0]
    copies = UpcycleCopies(recipe, dense)
    layout = stored_layout(dense.family.moe_layout(dense.where(), recipe.shared_experts > 0,
                                                   recipe.layout), recipe.output)
    if recipe.shared_experts and layout.shared_count_key is None:
        raise RecipeError(f"shared_experts: the {layout.name} layout has no shared expert made "
                          "of expert-width slices; use layout: deepseek (Llama / Mistral "
                          "sources)")
    refuse_unsupported_tensors(dense, layout)
    dtype = output_dtype(recipe.output.dtype, dense)
    hidden, m, s = dense.config["hidden_size"], recipe.granularity, recipe.shared_experts
    jobs: list[Job] = []
    layers_done: set[int] = set()
    largest = 0
    for name in write_order(dense.roles):
        role = dense.roles[name]
        shape = dense.reader.meta(name).shape
        if role.role != "ffn":
            jobs.append(Job(name, shape, dtype, "copy", role.role, role.layer, (Source(0, name),)))
            continue
        largest = max(largest, math.prod(shape))
        if role.layer not in layers_done:  # the router and shared-expert stubs, once per layer
            layers_done.add(role.layer)
            jobs.append(Job(layout.router_name(role.layer), (recipe.num_experts, hidden), dtype,
                            "router", "router", role.layer, router_init=recipe.router.init))
            if not s:
                jobs += zeroed_shared_expert(layout, dense, role.layer, dtype)  # Qwen2-MoE
        if s:  # the shared expert: the dense FFN's first s slices
            units = DenseUnits(role.proj, 0, s * copies.width)
            jobs.append(Job(layout.shared_name(role.layer, role.proj), units.shape(shape), dtype,
                            "copy", "ffn", role.layer, (Source(0, name, change=units),)))
        r = recipe.routed_slices
        for c in range(recipe.experts):
            for j in range(s, m):
                part = UpcycledSlice(copies, name, role.proj, role.layer, c, j)
                jobs.append(Job(layout.expert_name(role.layer, c * r + j - s, role.proj),
                                part.shape(shape), dtype, "copy", "ffn", role.layer,
                                (Source(0, name, change=part),)))
    source = dict(dense.config, intermediate_size=copies.width)
    config = moe_config(source, layout, dtype, num_experts=recipe.num_experts,
                        experts_per_token=recipe.top_k,
                        shared_width=s * copies.width if s else None)
    return Plan([dense.label], fuse_jobs(layout, jobs), config,
                resident_bytes=copies.resident_bytes(largest),
                notes=downstream_notes(layout, recipe.top_k, recipe.num_experts, shared=bool(s)))
