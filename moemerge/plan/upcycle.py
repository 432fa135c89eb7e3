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

The expert tensors are made on read by `UpcycledFFNs`, a reader over the dense checkpoint whose
tensors are named `<dense name>#copy<c>.slice<j>`; the plan copies them like any input tensor, so
execution needs nothing new. Drop-Upcycling re-initialisation and noise are drawn from generators
of (seed, tensor name): the same recipe gives the same bytes.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from moemerge.architectures.config import moe_config
from moemerge.errors import RecipeError
from moemerge.merge.primitives import generator_for
from moemerge.plan.build import refuse_unsupported_tensors
from moemerge.plan.common import output_dtype, write_order
from moemerge.plan.fused import fuse_jobs
from moemerge.plan.jobs import Job, Plan, Source
from moemerge.plan.shared import zeroed_shared_expert
from moemerge.plan.sources import SourceModel
from moemerge.recipe.upcycle import UpcycleRecipe

VIEW_LABEL = "upcycled"


@dataclass(frozen=True)
class _Meta:
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass(frozen=True)
class _Part:
    dense: str  # the dense FFN tensor
    proj: str  # gate / up / down
    layer: int
    copy: int
    slice: int


class UpcycledFFNs:
    """A read-only checkpoint reader whose tensors are the experts' FFN slices, computed from
    the dense model's FFN tensors when read (float32)."""

    def __init__(self, recipe: UpcycleRecipe, dense: SourceModel):
        self.recipe, self.dense = recipe, dense
        self.config = dense.config
        intermediate, m = dense.config["intermediate_size"], recipe.granularity
        if intermediate % m:
            raise RecipeError(f"granularity: {m} does not divide the dense model's "
                              f"intermediate_size {intermediate}; each expert would not be a "
                              "whole number of units")
        self.width = intermediate // m
        self.parts: dict[str, _Part] = {}
        for name, role in dense.roles.items():
            if role.role == "ffn":
                for c in range(recipe.experts):
                    for j in range(m):
                        self.parts[self.name(name, c, j)] = _Part(name, role.proj, role.layer, c, j)
        # the last dense tensor and the last copy of it: a plan reads the m slices of each of
        # the N copies of one dense tensor in a row, so each dense tensor is read once
        self._dense: tuple[str, torch.Tensor] | None = None
        self._cache: tuple[tuple[str, int], torch.Tensor] | None = None
        self._lock = threading.Lock()

    @staticmethod
    def name(dense: str, copy: int, slice_: int) -> str:
        return f"{dense}#copy{copy}.slice{slice_}"

    def names(self) -> list[str]:
        return list(self.parts)

    def __contains__(self, name: object) -> bool:
        return name in self.parts

    @property
    def resident_bytes(self) -> int:
        """What the reader itself holds at most beyond the slices it returns, measured
        (tests/integration/test_memory_bound.py): the float32 dense tensor and its copy, the
        allocator's arenas of the reader thread that slices them (two more float32 tensors:
        the unchanged copy measured up to 93 MiB over the estimate without them, with L of
        24 MiB), and when the copy is changed (reinit, noise) its random draws."""
        dense = {part.dense for part in self.parts.values()}
        largest = max((math.prod(self.dense.reader.meta(n).shape) for n in dense), default=0)
        changed = self.recipe.reinit.ratio > 0 or self.recipe.noise > 0
        return 4 * largest * (6 if changed else 4)

    def meta(self, name: str) -> _Meta:
        part = self.parts[name]
        rows, cols = self.dense.reader.meta(part.dense).shape
        return _Meta((rows, self.width) if part.proj == "down" else (self.width, cols))

    def read(self, name: str) -> torch.Tensor:
        part, m = self.parts[name], self.recipe.granularity
        with self._lock:
            key = (part.dense, part.copy)
            if self._cache is None or self._cache[0] != key:
                self._cache = None  # freed before the next copy is made: one copy at a time
                self._cache = (key, self._copy(part))
            full = self._cache[1]
        units = slice(part.slice * self.width, (part.slice + 1) * self.width)
        if part.proj == "down":  # ×m: the m slices of a copy share its router weight (above)
            return (full[:, units] * m).contiguous()
        return full[units].clone()  # its own memory: never a view of the cached copy

    def _copy(self, part: _Part) -> torch.Tensor:
        """Copy `part.copy` of one dense FFN tensor: re-initialised units, then noise."""
        if self._dense is None or self._dense[0] != part.dense:
            self._dense = None  # the previous dense tensor is freed first
            self._dense = (part.dense, self.dense.reader.read(part.dense).float())
        weight = self._dense[1]  # never modified in place: the next copy starts from it
        axis = 1 if part.proj == "down" else 0  # the intermediate units' axis
        units = self.reinit_units(part.layer, part.copy)
        if len(units) or self.recipe.noise > 0:
            weight = weight.clone()  # then changed in place: one float32 tensor at a time
        if len(units):
            shape = list(weight.shape)
            shape[axis] = len(units)
            fresh = torch.randn(shape, generator=generator_for(
                self.reinit_seed, f"{part.dense} copy {part.copy} reinit"))
            dense = self._dense[1]
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
        total = self.dense.config["intermediate_size"]
        count = round(self.recipe.reinit.ratio * total)
        if count == 0:
            return torch.empty(0, dtype=torch.long)
        order = torch.randperm(total, generator=generator_for(
            self.reinit_seed, f"model.layers.{layer} copy {copy} reinit units"))
        return order[:count].sort().values


def upcycle_sources(recipe: UpcycleRecipe, models: list[SourceModel]) -> list[SourceModel]:
    """[dense] -> [dense, the view of its experts' FFN slices] (what plan_upcycle reads)."""
    dense = models[0]
    view = UpcycledFFNs(recipe, dense)
    return [dense, SourceModel(VIEW_LABEL, dense.path, view, dense.family, {})]


def plan_upcycle(recipe: UpcycleRecipe, models: list[SourceModel]) -> Plan:
    """models = upcycle_sources(...): non-FFN tensors copied from the dense model, a router per
    layer, and experts c·m + j = slice j of copy c."""
    dense, view = models[0], models[1].reader
    layout = dense.family.moe_layout(dense.where())
    refuse_unsupported_tensors(dense, layout)
    dtype = output_dtype(recipe.output.dtype, dense)
    hidden, m = dense.config["hidden_size"], recipe.granularity
    jobs: list[Job] = []
    layers_done: set[int] = set()
    for name in write_order(dense.roles):
        role = dense.roles[name]
        if role.role != "ffn":
            jobs.append(Job(name, dense.reader.meta(name).shape, dtype, "copy", role.role,
                            role.layer, (Source(0, name),)))
            continue
        if role.layer not in layers_done:  # the router and shared-expert stubs, once per layer
            layers_done.add(role.layer)
            jobs.append(Job(layout.router_name(role.layer), (recipe.num_experts, hidden), dtype,
                            "router", "router", role.layer, router_init=recipe.router.init))
            jobs += zeroed_shared_expert(layout, dense, role.layer, dtype)  # Qwen2-MoE
        for c in range(recipe.experts):
            for j in range(m):
                part = view.name(name, c, j)
                jobs.append(Job(layout.expert_name(role.layer, c * m + j, role.proj),
                                view.meta(part).shape, dtype, "copy", "ffn", role.layer,
                                (Source(1, part),)))
    source = dict(dense.config, intermediate_size=view.width)
    config = moe_config(source, layout, dtype, num_experts=recipe.num_experts,
                        experts_per_token=recipe.top_k)
    return Plan([m_.label for m_ in models], fuse_jobs(layout, jobs), config)
