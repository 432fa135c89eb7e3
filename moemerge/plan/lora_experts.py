"""Plan of the LoRA-experts kind: the base's tensors copied once, and for every linear module an
adapter targets, the experts' factors stacked (A [E, R, I], B [E, O, R], each B times its
adapter's scale, ranks below R zero-padded, zeros for an expert that leaves the module alone),
plus a router [E, H] for each block holding such modules (modeling_lora_moemerge.py)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from moemerge.architectures.config import lora_config
from moemerge.errors import MismatchError
from moemerge.io.adapter import AdapterReader, LoraAdapter, LoraModule
from moemerge.plan.common import output_dtype, write_order
from moemerge.plan.jobs import Job, Plan, Source
from moemerge.plan.sources import SourceModel
from moemerge.recipe.lora_experts import LoraExpertsRecipe

# a routable module: a linear layer one level below a decoder layer's block (mlp, self_attn)
MODULE = re.compile(r"model\.layers\.(\d+)\.([^.]+)\.([^.]+)\.weight")
ALTERNATIVE = ("an MoE of LoRA experts keeps one base, so only low-rank deltas of the decoder "
               "layers' linear modules can be routed; build assembly: token_routed from the "
               "adapters (each merged into its expert as it is read) instead")


@dataclass(frozen=True, eq=False)
class LoraFactor:
    """A source change: one adapter's factor of one module, as the stack stores it: A [r, I]
    zero-padded to [R, I], or s·B [O, r] zero-padded to [O, R], in float32. The base's weight
    (the source's tensor) is not read."""

    adapter: LoraAdapter
    lora: LoraModule
    factor: Literal["A", "B"]
    rank: int  # R, the stack's
    reads_stored = False  # the adapter's factor, not the weight the source names

    def apply(self, read: Callable[[], torch.Tensor]) -> torch.Tensor:
        pad = self.rank - self.lora.r
        if self.factor == "A":
            return F.pad(self.adapter.read(self.lora.a.name).float(), (0, 0, 0, pad))
        return F.pad(self.adapter.read(self.lora.b.name).float() * self.lora.scale, (0, pad))

    def shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:  # stored: W [O, I]
        return (self.rank, stored[1]) if self.factor == "A" else (stored[0], self.rank)

    def dtype(self, stored: torch.dtype) -> torch.dtype:
        return torch.float32

    def describe(self) -> str:
        padded = f", zero-padded to {self.rank}" if self.lora.r < self.rank else ""
        scaled = f" × {self.lora.scale:g}" if self.factor == "B" else ""
        return f"LoRA {self.factor}{scaled} (r={self.lora.r}{padded})"


def plan_lora_experts(recipe: LoraExpertsRecipe, models: list[SourceModel]) -> Plan:
    """models = [base] + experts, each the base with its adapter."""
    base, experts = models[0], list(range(1, len(models)))
    if base.family.layout is not None:
        raise MismatchError(f"{base.where()} is an MoE; lora_experts puts adapters of a dense "
                            "model side by side")
    adapters = {i: _adapter(models[i]) for i in experts}
    targets = _targets(base, models, adapters)  # {weight: {expert: LoraModule}}
    for i, adapter in adapters.items():
        if adapter.replaced:
            whole = ", ".join(sorted(adapter.replaced)[:3])
            raise MismatchError(f"{models[i].label}: {adapter.where} replaces whole tensors "
                                f"({whole}: modules_to_save or trained biases); {ALTERNATIVE}")
    dtype = output_dtype(recipe.output.dtype, base)
    n, hidden = len(experts), base.config["hidden_size"]
    std = recipe.router.std or base.config.get("initializer_range", 0.02)
    jobs, routed, ranks = [], set(), {}
    for name in write_order(base.roles):
        role = base.roles[name]
        jobs.append(Job(name, base.reader.meta(name).shape, dtype, "copy", role.role, role.layer,
                        (Source(0, name),)))
        if name not in targets:
            continue
        layer, block, _ = MODULE.fullmatch(name).groups()
        module = name.removesuffix(".weight")
        rows, cols = base.reader.meta(name).shape
        rank = ranks[module] = max(lora.r for lora in targets[name].values())
        for factor, shape in (("A", (rank, cols)), ("B", (rows, rank))):
            parts = tuple((_factor_job(name, shape, dtype, int(layer), i, adapters[i],
                                       targets[name].get(i), factor, rank),) for i in experts)
            jobs.append(Job(f"{module}.lora_{factor}", (n, *shape), dtype, "fuse", "lora",
                            int(layer), parts=parts))
        router = f"model.layers.{layer}.{block}.router.weight"
        if router not in routed:
            routed.add(router)
            jobs.append(Job(router, (n, hidden), dtype, "router", "router", int(layer),
                            router_init=recipe.router.init, std=std))
    config = lora_config(base.config, [models[i].label for i in experts], dtype=dtype,
                         experts_per_token=recipe.top_k, lora_ranks=ranks)
    notes = [] if ranks else ["no adapter targets a linear module: the output is the base"]
    return Plan([m.label for m in models], jobs, config, notes)


def _factor_job(name: str, shape, dtype, layer: int, expert: int, adapter: LoraAdapter,
                lora: LoraModule | None, factor: str, rank: int) -> Job:
    """One expert's rows of a stack: its factor, or zeros where its adapter skips the module."""
    if lora is None:
        return Job(f"{name}:{factor}{expert}", shape, dtype, "zeros", "lora", layer)
    change = LoraFactor(adapter, lora, factor, rank)
    return Job(f"{name}:{factor}{expert}", shape, dtype, "copy", "lora", layer,
               (Source(expert, name, change=change),))


def _adapter(model: SourceModel) -> LoraAdapter:
    assert isinstance(model.reader, AdapterReader), "the recipe gives every expert an adapter"
    return model.reader.adapter


def _targets(base: SourceModel, models: list[SourceModel], adapters: dict[int, LoraAdapter]
             ) -> dict[str, dict[int, LoraModule]]:
    """{base weight name: {expert index: its LoRA of that module}}, every module checked."""
    targets: dict[str, dict[int, LoraModule]] = {}
    for i, adapter in adapters.items():
        for name, lora in adapter.modules.items():
            where = f"{models[i].label}: {adapter.where}: module {lora.module!r}"
            if lora.embedding or lora.bias is not None:
                what = "an embedding LoRA" if lora.embedding else "a lora_bias"
                raise MismatchError(f"{where} has {what}; {ALTERNATIVE}")
            role = base.roles.get(name)
            if MODULE.fullmatch(name) is None or role is None or role.role not in ("attn",
                                                                                  "ffn"):
                raise MismatchError(f"{where} is not a linear module of a decoder layer's "
                                    f"attention or FFN; {ALTERNATIVE}")
            targets.setdefault(name, {})[i] = lora
    return targets
