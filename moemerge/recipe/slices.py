"""`slices` of a dense merge (`kind: merge`): the output's layers as a stack of slices, each
the merge of the same number of consecutive layers from one or more models (mergekit's
`slices`). With `method: passthrough` and one source per slice this is layer stacking: the
output may have more or fewer layers than its inputs."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from moemerge.recipe.base import MergeInput, ModelRef, Strict, at_most


class SliceSource(MergeInput):  # type: ignore[valid-type, misc]
    layers: tuple[int, int] = Field(description="[start, end): the layers taken, end excluded "
                                    "(mergekit's layer_range).")

    @field_validator("layers")
    @classmethod
    def _ordered(cls, value: tuple[int, int]) -> tuple[int, int]:
        if not 0 <= value[0] < value[1]:
            raise ValueError(f"must be [start, end) with 0 <= start < end, got {list(value)}")
        return value

    @property
    def count(self) -> int:
        return self.layers[1] - self.layers[0]


class Slice(Strict):
    """Consecutive output layers, merged from `sources` (all of the same length)."""

    sources: list[SliceSource] = Field(min_length=1)

    _counted = field_validator("sources", mode="before")(at_most)

    @model_validator(mode="before")
    @classmethod
    def _one_source_shorthand(cls, value):
        """`{model: x, layers: [0, 4]}` is shorthand for `{sources: [{model: x, ...}]}`."""
        if isinstance(value, dict) and "sources" not in value and "model" in value:
            return {"sources": [value]}
        return value

    @model_validator(mode="after")
    def _same_length(self) -> Slice:
        counts = {s.count for s in self.sources}
        if len(counts) > 1:
            raise ValueError(f"sources: every source of a slice takes the same number of "
                             f"layers; these take {sorted(counts)}")
        return self

    @property
    def count(self) -> int:
        return self.sources[0].count


def slice_models(slices: list[Slice]) -> list[ModelRef]:
    """The distinct checkpoints the slices read, in order of first use."""
    seen: dict[tuple, ModelRef] = {}
    for s in slices:
        for src in s.sources:
            seen.setdefault(source_key(src), ModelRef(model=src.model, revision=src.revision,
                                                      lora=src.lora,
                                                      lora_revision=src.lora_revision))
    return list(seen.values())


def source_key(ref: ModelRef) -> tuple:
    """What tells two slice sources' checkpoints apart: the model, its revision and its LoRA
    adapter."""
    return ref.model, ref.revision, ref.lora, ref.lora_revision
