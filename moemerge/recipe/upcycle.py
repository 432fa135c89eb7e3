"""`kind: upcycle`: one dense model becomes an MoE of N copies of its FFN (docs/recipes.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from moemerge.bounds import MAX_EXPERTS
from moemerge.recipe.base import ModelRef, RecipeBase, Strict, refs_from_str


class UpcycleRouter(Strict):
    # virtual_group: the m slices of one copy start with identical logits, so they are chosen
    # together and the start reproduces the dense model at any granularity (docs/recipes.md)
    init: Literal["random", "virtual_group"] = "virtual_group"
    std: float | None = Field(default=None, gt=0.0, description="Std of the random rows.")


class Reinit(Strict):
    """Drop-Upcycling: per copy, a random fraction `ratio` of the intermediate units (the same
    units of gate, up and down) is drawn again from N(mean, std) of the dense tensor."""

    ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, description="Defaults to the recipe's seed.")


class UpcycleRecipe(RecipeBase):
    kind: Literal["upcycle"]
    model: ModelRef
    experts: int = Field(ge=1, le=MAX_EXPERTS, description="Copies of the dense FFN.")
    granularity: int = Field(default=1, ge=1, description="Slices per copy, along the "
                             "intermediate dimension: experts × granularity fine-grained experts.")
    experts_per_token: int = Field(default=2, ge=1, description="Copies chosen per token; "
                                   "the router picks experts_per_token × granularity slices.")
    shared_experts: int = Field(default=0, ge=0, description="Slices of the dense FFN kept "
                                "always on, once, as the shared expert (DeepSeekMoE's shared "
                                "expert isolation; a DeepSeek-MoE output): each copy keeps the "
                                "other granularity − shared_experts slices as routed experts.")
    layout: str | None = Field(default=None, description="The output's MoE layout (as in "
                               "`kind: moe`); default: the family's, DeepSeek-MoE for Llama "
                               "with shared_experts.")
    router: UpcycleRouter = UpcycleRouter()
    reinit: Reinit = Reinit()
    noise: float = Field(default=0.0, ge=0.0, description="Std of Gaussian noise added to "
                         "each copy's FFN weights.")

    _model_ref = field_validator("model", mode="before")(refs_from_str)

    @property
    def inputs(self) -> list[ModelRef]:
        return [self.model]

    @property
    def routed_slices(self) -> int:
        """Slices of each copy that become routed experts."""
        return self.granularity - self.shared_experts

    @property
    def num_experts(self) -> int:
        return self.experts * self.routed_slices

    @property
    def top_k(self) -> int:
        return self.experts_per_token * self.routed_slices

    @model_validator(mode="after")
    def _inputs_usable(self) -> UpcycleRecipe:
        """Replaces the base check (`experts` is a count here, not a list of models)."""
        if self.experts_per_token > self.experts:
            raise ValueError(f"experts_per_token: {self.experts_per_token} is larger than the "
                             f"number of experts ({self.experts})")
        if self.shared_experts >= self.granularity:
            raise ValueError(f"shared_experts: {self.shared_experts} of the {self.granularity} "
                             "slices (granularity) would leave no slice to route; give fewer, "
                             "or a larger granularity")
        if self.num_experts > MAX_EXPERTS:
            raise ValueError(f"granularity: experts × (granularity − shared_experts) = "
                             f"{self.num_experts:,} routed experts; an MoE has at most "
                             f"{MAX_EXPERTS} experts (llama.cpp loads at most 1024)")
        return self
