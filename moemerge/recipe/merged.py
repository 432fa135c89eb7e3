"""Recipe schema of the merged-experts kind (`assembly: merged_experts`: SMEAR / Lory / CAMEx):
each FFN becomes, per segment of tokens, a router-weighted merge of the experts' FFN weights,
optionally through curvature matrices (moemerge/modeling/modeling_merged_moemerge.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from moemerge.recipe.base import (
    CalibrationSpec,
    ExpertRef,
    ModelRef,
    RecipeBase,
    Strict,
    calibration_problem,
)
from moemerge.recipe.merge import MergeSpec, method_problems


class CurvatureSpec(Strict):
    kind: Literal["none", "kronecker"] = Field(
        default="kronecker", description="kronecker: CAMEx curvature M_i, Kronecker-factored, "
        "starting at the identity; none: plain soft merging (SMEAR / Lory).")
    rank: int = Field(default=1, ge=1, description="R: sum of R Kronecker products (averaged).")


class MaskSpec(Strict):
    kind: Literal["none", "ties", "dare"] = Field(
        default="none", description="ties: keep entries of M_i τ_i whose sign agrees with the "
        "elected sign (TIES-CA); dare: in training, drop whole experts per segment (DARE-CA).")
    p: float = Field(default=0.1, ge=0.0, lt=1.0, description="dare: drop probability.")


class MergedRouterSpec(Strict):
    init: Literal["random", "calibrate"] = Field(
        default="random", description="random, or calibrate: ridge regression per layer from "
        "segment means to expert targets on `calibration` data (docs/routing.md).")
    std: float | None = Field(default=None, gt=0.0, description="Std of the random routers; "
                              "default initializer_range (near-uniform scores: W starts near "
                              "E_m + α · mean τ).")


class MergedExpertsRecipe(RecipeBase):
    kind: Literal["moe"]
    assembly: Literal["merged_experts"]
    base_model: ModelRef
    reference: ModelRef | None = Field(default=None, description="The model whose FFNs are "
                                       "E_m, the reference of the task vectors; default the "
                                       "base.")
    experts: list[ExpertRef] = Field(min_length=1)
    merge: MergeSpec = MergeSpec()
    segment_length: int = Field(default=64, ge=1, description="T: tokens per routed segment.")
    alpha: float = Field(default=1.0, description="α, the scale of the merged task vectors.")
    curvature: CurvatureSpec = CurvatureSpec()
    mask: MaskSpec = MaskSpec()
    dynamic: bool = Field(default=False, description="Dynamic-Merg: E_m travels up the layers; "
                          "layers after the first store no E_m.")
    router: MergedRouterSpec = MergedRouterSpec()
    calibration: CalibrationSpec | None = None

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    @model_validator(mode="after")
    def _no_ffn_merge(self) -> MergedExpertsRecipe:
        problems = method_problems(self.merge, len(self.experts), has_base=True, moe=True)
        if problems:
            raise ValueError("; ".join(problems))
        if any(o.roles and "ffn" in o.roles for o in self.merge.overrides):
            raise ValueError("merge.overrides: role 'ffn' is merged per segment by the router "
                             "in merged_experts, not by the recipe; remove it")
        if problem := calibration_problem(self.router.init == "calibrate", self.calibration,
                                          self.num_experts):
            raise ValueError(problem)
        return self
