"""`kind: shrink`: fewer experts per layer for a token-routed MoE (docs/shrink.md).

The same fields as `moemerge shrink MOE OUT ...`, which writes one of these as the output's
recipe copy, so `moemerge build` of that copy makes the same model again.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from moemerge.recipe.models import CalibrationText, ModelRef, _RecipeBase, _refs_from_str

Method = Literal["prune", "merge"]
Saliency = Literal["reap", "frequency"]


class ShrinkRecipe(_RecipeBase):
    kind: Literal["shrink"]
    model: ModelRef = Field(description="The token-routed MoE to shrink (Mixtral, Qwen2-MoE, "
                            "Qwen3-MoE, FlexOlmo, GraniteMoE), built by moemerge or not.")
    experts: int | None = Field(default=None, ge=1, le=4096, description="Experts kept per "
                                "layer (or `ratio`).")
    ratio: float | None = Field(default=None, gt=0.0, le=1.0, description="Share of the "
                                "experts kept per layer, rounded, at least 1 (or `experts`).")
    method: Method = Field(default="prune", description="prune: keep the most salient experts; "
                           "merge: cluster similar experts and average each cluster.")
    saliency: Saliency = Field(default="reap", description="reap: mean gate weight × expert "
                               "output norm over the tokens routed to the expert (Lasby et "
                               "al. 2025); frequency: share of the top-k slots.")
    calibration: CalibrationText = Field(description="The text the statistics (and the router "
                                         "repair) are computed on.")
    repair: bool = Field(default=True, description="Refit each router by ridge regression to "
                         "the original model's routing mapped onto the kept experts.")
    merge_sample: int = Field(default=512, ge=1, le=2**20, description="merge: tokens per "
                              "layer on which every expert's output is compared.")

    _model_ref = field_validator("model", mode="before")(_refs_from_str)

    @property
    def inputs(self) -> list[ModelRef]:
        return [self.model]

    @model_validator(mode="after")
    def _inputs_usable(self) -> ShrinkRecipe:
        """Replaces the base check: one of experts / ratio, not both."""
        if (self.experts is None) == (self.ratio is None):
            raise ValueError("experts: give the experts kept per layer (`experts: K`) or a "
                             "share of them (`ratio: r`), not both")
        return self

    def kept(self, num_experts: int) -> int:
        """K for an MoE of `num_experts` experts per layer."""
        if self.experts is not None:
            return self.experts
        return max(1, round(self.ratio * num_experts))
