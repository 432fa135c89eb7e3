"""Recipe schema: pydantic models, strict (an unknown or misspelt key is an error).

No torch import here: a recipe can be validated without loading any tensor library.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from moemerge.recipe.merge import (  # noqa: F401  (re-exported: the recipe kinds' shared names)
    METHODS_NEEDING_BASE,
    MergeSpec,
    Override,
    Role,
    method_problems,
)

OutputDType = Literal["auto", "float32", "float16", "bfloat16"]


def _refs_from_str(value):
    """Let a model reference, or a list of them, be a plain string: shorthand for `{model: ...}`."""
    if isinstance(value, str):
        return {"model": value}
    if isinstance(value, list):
        return [{"model": v} if isinstance(v, str) else v for v in value]
    return value


class Strict(BaseModel):
    # every float must be finite: a NaN lambda or an infinite weight builds a NaN model
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelRef(Strict):
    """A dense checkpoint: a local directory or a hub id (`org/name`), optional revision."""

    model: str = Field(min_length=1)
    revision: str | None = None
    weight: float = Field(default=1.0, ge=0.0, description="Weight in non-FFN merges.")


class ExpertRef(ModelRef):
    name: str | None = Field(default=None, description="Display name; defaults to the dir name.")
    positive_prompts: list[str] = Field(default_factory=list)
    negative_prompts: list[str] = Field(default_factory=list)


class RouterSpec(Strict):
    init: Literal["random", "prompts", "cheap_embed", "task_vector"] = "random"
    std: float | None = Field(default=None, gt=0.0, description="Std of random init.")
    max_prompt_tokens: int = Field(default=512, gt=0)


class OutputSpec(Strict):
    dtype: OutputDType = "auto"
    max_shard_size: str | int = "5GB"


class _RecipeBase(Strict):
    name: str | None = None
    seed: int = 0
    output: OutputSpec = OutputSpec()

    # one validator for the model fields of every recipe kind (check_fields: not all have all)
    _model_refs = field_validator(
        "base_model", "models", "experts", mode="before", check_fields=False
    )(_refs_from_str)

    @model_validator(mode="after")
    def _inputs_usable(self):
        """Weights that can be normalised, and expert names that tell experts apart."""
        field = "models" if hasattr(self, "models") else "experts"
        refs = getattr(self, field, None) or []
        if refs and sum(r.weight for r in refs) <= 0:
            raise ValueError(f"{field}: the weights sum to 0; give at least one model a weight "
                             "above 0")
        names = [r.name for r in refs if getattr(r, "name", None) is not None]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"{field}: expert name(s) {', '.join(map(repr, twice))} given "
                             "more than once; each expert needs its own name")
        return self


class MergeRecipe(_RecipeBase):
    """`kind: merge`: N dense models of one architecture become one dense model."""

    kind: Literal["merge"]
    base_model: ModelRef | None = None
    models: list[ModelRef] = Field(default_factory=list, description="The models to merge "
                                   "(or `slices`).")
    slices: list[Slice] | None = Field(default=None, description="The output's layers as "
                                       "slices of the inputs' (moemerge/recipe/slices.py).")
    merge: MergeSpec = MergeSpec()

    @property
    def inputs(self) -> list[ModelRef]:
        """The checkpoints merged: `models`, or those the slices read."""
        return slice_models(self.slices) if self.slices else self.models

    @model_validator(mode="after")
    def _methods_fit(self) -> MergeRecipe:
        if bool(self.models) == bool(self.slices):
            raise ValueError("models: give the models to merge, or `slices` (layer ranges of "
                             "them), " + ("not both" if self.models else "one of them"))
        counts = sorted({len(s.sources) for s in self.slices}) if self.slices else [
            len(self.models)]
        problems = [p for n in counts for p in method_problems(
            self.merge, n, has_base=self.base_model is not None, moe=False)]
        if problems:
            raise ValueError("; ".join(dict.fromkeys(problems)))
        return self


class MoERecipe(_RecipeBase):
    """`kind: moe`: a base plus N dense experts branched from it become one MoE."""

    kind: Literal["moe"]
    assembly: Literal["token_routed"] = "token_routed"
    base_model: ModelRef
    experts: list[ExpertRef] = Field(min_length=1)
    include_base_expert: bool = Field(
        default=False, description="Add the base model's own FFN as one more expert."
    )
    experts_per_token: int = Field(default=2, ge=1)
    shared_expert: Literal["none", "base", "average"] = Field(
        default="none",
        description="The always-on shared expert of layouts that have one (Qwen2-MoE): the "
        "base's FFN, the experts' FFN average, or none (zeros).",
    )
    merge: MergeSpec = MergeSpec()
    router: RouterSpec = RouterSpec()

    @property
    def num_experts(self) -> int:
        return len(self.experts) + int(self.include_base_expert)

    @model_validator(mode="after")
    def _k_fits(self) -> MoERecipe:
        problems = method_problems(self.merge, len(self.experts), has_base=True, moe=True)
        if problems:
            raise ValueError("; ".join(problems))
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token: {self.experts_per_token} is larger than the number of experts "
                f"({self.num_experts})"
            )
        if any(o.roles and "ffn" in o.roles for o in self.merge.overrides):
            raise ValueError(
                "merge.overrides: role 'ffn' cannot be merged in kind: moe (each expert's FFN "
                "becomes an MoE expert); remove it"
            )
        if self.router.init in ("prompts", "cheap_embed"):
            missing = [e.name or e.model for e in self.experts if not e.positive_prompts]
            if missing:
                raise ValueError(
                    f"router.init: '{self.router.init}' needs positive_prompts for every expert; "
                    "missing for " + ", ".join(missing)
                )
        return self


from moemerge.recipe.slices import Slice, slice_models  # noqa: E402  (slices.py uses ModelRef)

MergeRecipe.model_rebuild()
