"""Recipe schema of the LoRA-experts kind (`assembly: lora_experts`: X-LoRA / MoLE / mergoo):
one copy of the base, each expert a LoRA adapter of it, mixed per token by a router in every
block the adapters target (moemerge/modeling/modeling_lora_moemerge.py; docs/lora.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from moemerge.recipe.base import (
    PROMPTED,
    CalibrationSpec,
    ExpertRef,
    ModelRef,
    RecipeBase,
    Strict,
    calibration_problem,
)


class LoraRouterSpec(Strict):
    init: Literal["random", "uniform", "prompts", "calibrate"] = Field(
        default="random", description="random (N(0, std²)); uniform (U(-1/√H, 1/√H)); prompts: "
        "each expert's prompts' mean block input through the base, centred across experts; "
        "calibrate: ridge regression per router on `calibration` text (docs/routing.md).")
    std: float | None = Field(default=None, gt=0.0, description="Std of random init; default "
                              "the base's initializer_range.")
    max_prompt_tokens: int = Field(default=512, gt=0, le=8192, description=(
        "Tokens of each prompt read by the prompts init."))


class LoraExpertsRecipe(RecipeBase):
    """`kind: moe`, `assembly: lora_experts`: the base once, the adapters as routed experts."""

    kind: Literal["moe"]
    assembly: Literal["lora_experts"] = Field(description=(
        "An MoE whose experts stay LoRA adapters of one base, mixed per token."))
    base_model: ModelRef = Field(description="The model every adapter was trained on; stored "
                                 "once.")
    experts: list[ExpertRef] = Field(min_length=1, description=(
        "The experts, each a LoRA adapter of the base: `{model: BASE, lora: ADAPTER}` or "
        "`BASE+ADAPTER`."))
    experts_per_token: int | Literal["all"] = Field(default=2, description=(
        "k, the adapters each token mixes (the top k of the router's softmax, renormalised); "
        "all: a dense mixture of every adapter."))
    router: LoraRouterSpec = Field(default=LoraRouterSpec(), description="How the routers "
                                   "start.")
    calibration: CalibrationSpec | None = Field(default=None, description=(
        "Text per expert that sets the routers (router.init: calibrate)."))

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    @property
    def top_k(self) -> int:
        return self.num_experts if self.experts_per_token == "all" else self.experts_per_token

    @model_validator(mode="after")
    def _experts_are_adapters(self) -> LoraExpertsRecipe:
        problems = []
        if self.base_model.lora is not None or self.base_model.expert is not None:
            problems.append("base_model: the base is stored as it is; give its directory or hub "
                            "id without `lora:` or `expert:`")
        for i, expert in enumerate(self.experts):
            if expert.lora is None:
                problems.append(f"experts.{i}: {expert.model} has no LoRA adapter; an expert of "
                                "lora_experts is `{model: BASE, lora: ADAPTER}` (a full "
                                "fine-tune is an expert of assembly: token_routed)")
            elif expert.model != self.base_model.model or expert.revision != \
                    self.base_model.revision or expert.expert is not None:
                problems.append(f"experts.{i}: the adapter is put on {expert.model}, not on "
                                f"base_model ({self.base_model.model}); every adapter is applied "
                                "to the one stored base")
        if self.experts_per_token != "all" and not 1 <= self.experts_per_token <= \
                self.num_experts:
            problems.append(f"experts_per_token: {self.experts_per_token} is not between 1 and "
                            f"the number of experts ({self.num_experts}), nor 'all'")
        if self.router.init in PROMPTED:
            missing = [e.name or e.lora for e in self.experts if not e.positive_prompts]
            if missing:
                problems.append(f"router.init: '{self.router.init}' needs positive_prompts for "
                                "every expert; missing for " + ", ".join(map(str, missing)))
        if problem := calibration_problem(self.router.init == "calibrate", self.calibration,
                                          self.num_experts):
            problems.append(problem)
        if problems:
            raise ValueError("; ".join(problems))
        return self
