"""`kind: shrink`: fewer experts per layer for a token-routed MoE (docs/shrink.md).

The same fields as `moemerge shrink MOE OUT ...`, which writes one of these as the output's
recipe copy, so `moemerge build` of that copy makes the same model again.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from moemerge.architectures.forms import moe_names
from moemerge.bounds import MAX_EXPERTS, MAX_SEQ_LEN
from moemerge.merge.registry import REGISTRY
from moemerge.recipe.base import CalibrationText, ModelRef, RecipeBase, refs_from_str

Method = Literal["prune", "merge"]
Saliency = Literal["reap", "frequency"]
WEIGHTED = "weighted"


def group_methods() -> list[str]:
    """What `merge_method` takes: the saliency-weighted mean, or a registry method that merges
    two or more models with no base (an MoE's experts have no common base on disk)."""
    return [WEIGHTED, *(name for name, spec in REGISTRY.items() if spec.target is not None
                        and not spec.needs_base and (spec.max_models or 2) >= 2)]


class ShrinkRecipe(RecipeBase):
    kind: Literal["shrink"]
    model: ModelRef = Field(description=f"A token-routed MoE ({moe_names()}), built by "
                            "moemerge or not.")
    experts: int | None = Field(default=None, ge=1, le=MAX_EXPERTS, description="Experts kept per "
                                "layer, K (at most the MoE's; below experts_per_token, that is "
                                "clipped to K). Or `ratio`.")
    ratio: float | None = Field(default=None, gt=0.0, le=1.0, description="Instead of `experts`: "
                                "the share of the experts kept per layer, in (0, 1], rounded, "
                                "at least 1.")
    method: Method = Field(default="merge", description="merge: cluster the experts by the "
                           "cosine similarity of their outputs into K groups and average each "
                           "group's weights, weighted by saliency (the default: on a real "
                           "4-expert MoE it lost the least at every K, docs/shrink.md). prune: "
                           "keep the K most salient experts of each layer.")
    saliency: Saliency = Field(default="reap", description="reap: mean over the tokens routed to "
                               "an expert of gate weight times the norm of the vector the "
                               "expert computes (REAP, Lasby et al. 2025). frequency: its share "
                               "of the top-k slots.")
    calibration: CalibrationText = Field(description="Calibration text, in the forms --data "
                                         "takes everywhere (a .txt or .jsonl file, a directory, "
                                         "name=path; docs/data.md): the statistics and the "
                                         "router repair are computed on it.")
    merge_method: str = Field(default=WEIGHTED, description="With method merge: how a group's "
                              "experts become one. weighted: their saliency-weighted mean; or "
                              "a merge method that needs no base model (karcher, multislerp, "
                              "average; slerp and nuslerp for groups of two), given the "
                              "saliency weights where it takes weights.")
    repair: bool = Field(default=True, description="Refit each router (ridge regression, as "
                         "router.init calibrate) to the original model's routing mapped onto "
                         "the experts kept; off: keep the kept (or frequency-averaged) router "
                         "rows.")
    merge_sample: int = Field(default=512, ge=1, le=MAX_SEQ_LEN, description="With method "
                              "merge: tokens per layer on which every expert's output is "
                              "compared.")

    _model_ref = field_validator("model", mode="before")(refs_from_str)

    @field_validator("merge_method")
    @classmethod
    def _group_method(cls, value: str) -> str:
        if value not in group_methods():
            raise ValueError(f"{value!r} cannot merge a group of experts: give one of "
                             f"{', '.join(group_methods())}")
        return value

    @property
    def inputs(self) -> list[ModelRef]:
        return [self.model]

    @model_validator(mode="after")
    def _inputs_usable(self) -> ShrinkRecipe:
        """Replaces the base check: one of experts / ratio, not both."""
        if (self.experts is None) == (self.ratio is None):
            raise ValueError("experts: give the experts kept per layer (`experts: K`) or a "
                             "share of them (`ratio: r`), not both")
        if self.merge_method != WEIGHTED and self.method != "merge":
            raise ValueError(f"merge_method: {self.merge_method} applies to method: merge only")
        if self.model.lora is not None:
            raise ValueError("model: shrink reads the MoE as it is stored and cannot apply a "
                             "LoRA adapter to it; write the MoE with its adapter first (kind: "
                             "merge with that one model), then shrink that")
        return self

    def kept(self, num_experts: int) -> int:
        """K for an MoE of `num_experts` experts per layer."""
        if self.experts is not None:
            return self.experts
        return max(1, round(self.ratio * num_experts))
