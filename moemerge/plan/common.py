"""What every planner shares: the output dtype, the order tensors are written in, and the job
that merges one tensor across models (plan/build.py, sequence.py, merged.py, slices.py,
upcycle.py, shared.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moemerge.architectures import MoELayout, TensorRole
from moemerge.architectures.forms import CLASSIC, FUSED, layout_of, written_layout
from moemerge.errors import RecipeError
from moemerge.merge.primitives import generator_for
from moemerge.merge.registry import get
from moemerge.plan.jobs import Job, Source
from moemerge.plan.params import resolve_merge, resolve_weights
from moemerge.plan.sources import SourceModel
from moemerge.recipe.base import ModelRef

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def output_dtype(requested: str, base: SourceModel) -> torch.dtype:
    """'auto' keeps the base's dtype: its config's, else that of its embedding tensor."""
    if requested != "auto":
        return DTYPES[requested]
    declared = base.config.get("torch_dtype") or base.config.get("dtype")
    if declared in DTYPES:
        return DTYPES[declared]
    embed = next(n for n, r in base.roles.items() if r.role == "embed")
    return base.reader.meta(embed).dtype


def stored_layout(layout: MoELayout, output) -> MoELayout:
    """The layout a token-routed plan writes, its experts stored as `output.experts` says;
    fused needs a transformers that reads the stacks (5 and later)."""
    if output.experts == FUSED:
        from importlib.metadata import version

        installed = version("transformers")
        if int(installed.split(".")[0]) < 5:
            raise RecipeError(f"output.experts: fused: transformers {installed} reads per-expert "
                              "tensors only (the fused stacks came with transformers 5); use "
                              "classic, which every version reads")
    return written_layout(layout, output.experts)


def check_expert_form(output, config: dict) -> None:
    """`output.experts: fused` on a recipe whose output has no token-routed experts."""
    if output.experts != CLASSIC and layout_of(config) is None:
        raise RecipeError(
            f"output.experts: {output.experts}: this recipe writes a "
            f"{config.get('model_type')} model, which has no token-routed experts to stack "
            "(token_routed, upcycle and merges of token-routed MoEs have); remove it")


def write_order(roles: dict[str, TensorRole]) -> list[str]:
    """Embeddings first, then layer by layer, then final norm and head: the order loaders read."""

    def key(name: str) -> tuple:
        role = roles[name]
        if role.layer is not None:
            return (1, role.layer, name)
        return (0 if role.role == "embed" else 2, 0, name)

    return sorted(roles, key=key)


def merge_job(
    name: str, role: str, layer: int | None, shape, dtype, spec, merged: list[int],
    refs: Sequence[ModelRef], base: int | None, *, output: str | None = None,
    num_layers: int | None = None,
) -> Job:
    """Output tensor `output` (default `name`) from the tensors `name` of the models `merged`,
    whose recipe entries (weights, own parameters) are `refs`; `num_layers` places `layer` on
    per-layer gradients."""
    output = output or name
    params = resolve_merge(spec, role, layer, num_layers, tensor=output, models=refs)
    weights = resolve_weights(refs, role, layer, num_layers, tensor=output)
    if params.method == "base":
        return Job(output, shape, dtype, "copy", role, layer, (Source(base, name),))
    if len(merged) == 1 and params.copies_its_one_model:
        return Job(output, shape, dtype, "copy", role, layer, (Source(merged[0], name),))
    reads_base = base is not None and get(params.method).base != "ignored"
    return Job(
        output, shape, dtype, "merge", role, layer,
        sources=tuple(Source(m, name) for m in merged),
        # a method that ignores the base never reads it: that would cost one more model's I/O
        base=Source(base, name) if reads_base else None,
        weights=tuple(weights),
        merge=params,
    )


@dataclass(frozen=True)
class ExpertWeights:
    """An expert's FFN tensor as mergekit-moe's expert options change it (a Source's change):
    N(0, noise²) added (drawn from (seed, the output tensor's name)), then, on the down
    projection, multiplied by `scale` (residual_scale: the expert's output scaled)."""

    noise: float
    scale: float
    seed: int
    key: str

    def apply(self, read: Callable[[], torch.Tensor]) -> torch.Tensor:
        weight = read().float()
        if self.noise:
            weight = weight + torch.randn(weight.shape, generator=generator_for(
                self.seed, f"{self.key} noise")) * self.noise
        return weight * self.scale if self.scale != 1 else weight

    def describe(self) -> str:
        return ", ".join(([f"noise std {self.noise:g}"] if self.noise else [])
                         + ([f"×{self.scale:g}"] if self.scale != 1 else []))

    def dtype(self, stored: torch.dtype) -> torch.dtype:
        return torch.float32

    def shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        return stored


def expert_source(model: int, name: str, proj: str | None, ref, seed: int,
                  output: str) -> Source:
    """Source of an expert's FFN tensor `name` (projection `proj`), with the expert's noise and
    residual scale (RoutedExpertRef) applied when it sets them."""
    noise = getattr(ref, "noise_scale", 0.0)
    scale = getattr(ref, "residual_scale", 1.0) if proj == "down" else 1.0
    if not noise and scale == 1:
        return Source(model, name)
    return Source(model, name, change=ExpertWeights(noise, scale, seed, output))
