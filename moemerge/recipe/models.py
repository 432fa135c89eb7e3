"""Recipe schema of the dense merge (`kind: merge`) and the token-routed MoE (`kind: moe`):
pydantic models, strict (an unknown or misspelt key is an error); the pieces every kind shares
are in recipe/base.py.

No torch import here: a recipe can be validated without loading any tensor library.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from moemerge.merge.registry import REGISTRY
from moemerge.recipe.base import (
    PROMPTED,
    CalibrationSpec,
    CalibrationText,
    ExpertRef,
    MergeInput,
    ModelRef,
    RecipeBase,
    RoutedExpertRef,
    RouterSpec,
    Strict,
    calibration_problem,
)
from moemerge.recipe.merge import (
    MergeSpec,
    method_problems,
    setting_values,
)
from moemerge.recipe.slices import Slice, slice_models


class TokenFrom(Strict):
    """One row of a model's embedding or head: its row of `token` (a string of its own
    vocabulary) or of `token_id`."""

    model: str = Field(min_length=1, description="One of the recipe's models, as written there.")
    token: str | None = None
    token_id: int | None = Field(default=None, ge=0, le=2**40)

    @model_validator(mode="after")
    def _one_of(self) -> TokenFrom:
        if (self.token is None) == (self.token_id is None):
            raise ValueError("give token or token_id (one of them)")
        return self


class TokenEmbedding(Strict):
    """Where an output token's embedding and head rows come from in every merged model that
    lacks it (with `force`: in every model): `zero`, a model's own row of the token (the
    model as written in the recipe), or another token's row of a model."""

    source: Literal["zero"] | str | TokenFrom | None = None
    force: bool = Field(default=False, description="Use `source` even in models that have the "
                        "token.")


class TokenizerSpec(Strict):
    """The output's vocabulary (mergekit's `tokenizer:`; plan/tokens.py): every model's
    embedding and head rows are re-indexed to it by token string before the merge."""

    source: str = Field(default="union", min_length=1, description="union (every model's "
                        "tokens: the base's, then each model's new ones), base (the base "
                        "model's, or the first model's), or one of the recipe's models.")
    tokens: dict[str, TokenEmbedding] = Field(default_factory=dict, description="Tokens added "
                                              "to the vocabulary when missing, and where their "
                                              "rows come from.")
    pad_to_multiple_of: int | None = Field(default=None, ge=1, le=2**20, description="Rows "
                                           "added (each the mean of the others) up to a "
                                           "multiple of this.")

    @field_validator("tokens")
    @classmethod
    def _no_empty_token(cls, tokens: dict[str, TokenEmbedding]) -> dict[str, TokenEmbedding]:
        if "" in tokens:
            raise ValueError("an empty token (\"\"); a token added to the vocabulary is at "
                             "least one character")
        return tokens

    def models_named(self) -> list[str]:
        """Every model this block names (source, tokens' sources)."""
        named = [] if self.source in ("union", "base") else [self.source]
        for entry in self.tokens.values():
            source = entry.source
            if isinstance(source, TokenFrom):
                named.append(source.model)
            elif isinstance(source, str) and source != "zero":
                named.append(source)
        return named


class MergedRouters(Strict):
    init: Literal["merge", "calibrate"] = Field(default="merge", description=(
        "merge: the inputs' routers merged like any tensor (the recipe's method); calibrate: "
        "then fitted again in closed form on the merged model to the inputs' own routing on "
        "the calibration text (HARC)."))


class MergeRecipe(RecipeBase):
    """`kind: merge`: N dense models of one architecture become one dense model."""

    kind: Literal["merge"] = Field(description="One dense model merged from several.")
    base_model: ModelRef | None = Field(default=None, description=(
        "The model task vectors are taken against (the methods that need one)."))
    models: list[MergeInput] = Field(  # type: ignore[valid-type]
        default_factory=list, description="The models to merge (or `slices`).")
    slices: list[Slice] | None = Field(default=None, description="The output's layers as "
                                       "slices of the inputs' (moemerge/recipe/slices.py).")
    merge: MergeSpec = MergeSpec()
    tokenizer: TokenizerSpec | None = Field(default=None, description="The output's "
                                            "vocabulary when the models' differ, or to add "
                                            "tokens (mergekit's `tokenizer:`); default: the "
                                            "base's (or first model's), which all must share.")
    router: MergedRouters = Field(default_factory=lambda: MergedRouters(), description=(
        "MoE inputs: how the output's routers are made."))
    calibration: CalibrationText | None = Field(default=None, description=(
        "MoE inputs, router.init: calibrate: text the routers are fitted on, each named after "
        "the input whose routing it should keep (name=path), or one mixed text."))

    @property
    def inputs(self) -> list[ModelRef]:
        """The checkpoints merged: `models`, or those the slices read."""
        return slice_models(self.slices) if self.slices else self.models

    @property
    def plan_refs(self) -> list[ModelRef]:
        """The models of a `models` merge in plan order: the base first, when there is one."""
        return ([self.base_model] if self.base_model is not None else []) + list(self.models)

    @property
    def tokenizer_index(self) -> int:
        """The model (plan order) whose tokenizer files the output starts from: the tokenizer
        block's source model, else the first."""
        if self.tokenizer is None or self.tokenizer.source in ("union", "base"):
            return 0
        return next(i for i, r in enumerate(self.plan_refs) if r.model == self.tokenizer.source)

    @property
    def merges_vocabularies(self) -> bool:
        """The models' vocabularies may differ: their rows are aligned to the output's."""
        return self.tokenizer is not None

    @model_validator(mode="after")
    def _methods_fit(self) -> MergeRecipe:
        if bool(self.models) == bool(self.slices):
            raise ValueError("models: give the models to merge, or `slices` (layer ranges of "
                             "them), " + ("not both" if self.models else "one of them"))
        counts = sorted({len(s.sources) for s in self.slices}) if self.slices else [
            len(self.models)]
        problems = [p for n in counts for p in method_problems(
            self.merge, n, has_base=self.base_model is not None, moe=False)]
        problems += own_setting_problems(self)
        if self.tokenizer is not None:
            problems += tokenizer_problems(self)
        calibrates = self.router.init == "calibrate"
        if calibrates and self.calibration is None:
            problems.append("router.init: 'calibrate' needs a `calibration: {data: ...}` block")
        if self.calibration is not None and not calibrates:
            problems.append("calibration: given, but router.init is not 'calibrate' (nothing "
                            "would read it)")
        if problems:
            raise ValueError("; ".join(dict.fromkeys(problems)))
        return self


class MoERecipe(RecipeBase):
    """`kind: moe`: a base plus N dense experts branched from it become one MoE."""

    kind: Literal["moe"] = Field(description="A Mixture-of-Experts model.")
    assembly: Literal["token_routed"] = Field(default="token_routed", description=(
        "How the experts are put together: a router per layer picks experts per token."))
    base_model: ModelRef = Field(description="The model the experts were fine-tuned from.")
    experts: list[RoutedExpertRef] = Field(min_length=1, description=(
        "The experts, each a model fine-tuned from the base; its FFNs become one expert."))
    include_base_expert: bool = Field(
        default=False, description="Add the base model's own FFN as one more expert."
    )
    experts_per_token: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        default=2, description="Experts each token uses; auto: chosen after the routers are "
        "calibrated (router.init: calibrate), the smallest k in 1..experts whose loss on "
        "held-out calibration windows is within 0.1 % of the best (the choice is written into "
        "the config and the recipe copy).")
    shared_expert: Literal["none", "base", "average"] | RoutedExpertRef = Field(
        default="none",
        description="The always-on shared expert (Qwen2-MoE, DeepSeek-MoE; a Llama base "
        "becomes a DeepSeek-MoE): the base's FFN, the experts' FFN average, another model's "
        "FFN (`{model: path, positive_prompts: [...]}`: its prompts set Qwen2-MoE's "
        "shared_expert_gate under the mergekit_* router inits), or none.",
    )
    layout: str | None = Field(
        default=None, description="The output's MoE layout (moemerge/architectures/moe.yaml): "
        "by default the base family's own (Llama: mixtral, with a shared expert deepseek); a "
        "Llama base can also be written as qwen2_moe (zero attention biases, a gated shared "
        "expert).")
    merge: MergeSpec = Field(default=MergeSpec(), description=(
        "How the tensors the experts share (attention, embeddings, norms, head) are merged."))
    router: RouterSpec = Field(default=RouterSpec(), description="How the routers start.")
    calibration: CalibrationSpec | None = Field(default=None, description=(
        "Text per expert that sets the routers (router.init: calibrate)."))

    @property
    def num_experts(self) -> int:
        return len(self.experts) + int(self.include_base_expert)

    @property
    def top_k(self) -> int:
        """Experts per token as planned: with `auto`, 2 (or 1 of 1) until calibration chooses."""
        if self.experts_per_token == "auto":
            return min(2, self.num_experts)
        return self.experts_per_token

    @property
    def shared_model(self) -> RoutedExpertRef | None:
        """The model whose FFN is the shared expert, when the recipe names one."""
        return self.shared_expert if isinstance(self.shared_expert, ExpertRef) else None

    @field_validator("shared_expert", mode="before")
    @classmethod
    def _shared_expert_named(cls, value: object) -> object:
        if isinstance(value, str) and value not in ("none", "base", "average"):
            raise ValueError(f"{value!r} is not none, base or average; another model's FFN is "
                             f"given as {{model: {value}}}")
        return value

    @model_validator(mode="after")
    def _k_fits(self) -> MoERecipe:
        problems = method_problems(self.merge, len(self.experts), has_base=True, moe=True)
        if problems:
            raise ValueError("; ".join(problems))
        if self.experts_per_token == "auto" and self.router.init != "calibrate":
            raise ValueError(
                "experts_per_token: 'auto' is chosen on held-out calibration windows after the "
                f"routers are calibrated; it needs router.init: calibrate (here "
                f"{self.router.init!r}), or give a number")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"experts_per_token: {self.top_k} is larger than the number of experts "
                f"({self.num_experts})"
            )
        if any(o.roles and "ffn" in o.roles for o in self.merge.overrides):
            raise ValueError(
                "merge.overrides: role 'ffn' cannot be merged in kind: moe (each expert's FFN "
                "becomes an MoE expert); remove it"
            )
        if self.router.init in PROMPTED:
            missing = [e.name or e.model for e in self.experts if not e.positive_prompts]
            if missing:
                raise ValueError(
                    f"router.init: '{self.router.init}' needs positive_prompts for every expert; "
                    "missing for " + ", ".join(missing)
                )
        if problem := calibration_problem(self.router.init == "calibrate", self.calibration,
                                          self.num_experts):
            raise ValueError(problem)
        return self


def merge_inputs(recipe: MergeRecipe) -> list[tuple[str, MergeInput]]:  # type: ignore[valid-type]
    """Every model entry of a dense merge with its field path: `models.1`, or
    `slices.0.sources.1`."""
    if recipe.slices:
        return [(f"slices.{i}.sources.{j}", src) for i, s in enumerate(recipe.slices)
                for j, src in enumerate(s.sources)]
    return [(f"models.{i}", m) for i, m in enumerate(recipe.models)]


def tokenizer_problems(recipe: MergeRecipe) -> list[str]:
    """A tokenizer block on slices, or naming a model the recipe does not merge."""
    assert recipe.tokenizer is not None
    if recipe.slices:
        return ["tokenizer: a merged vocabulary with `slices` is not supported; merge `models`"]
    known = {m.model for m in recipe.plan_refs}
    return [f"tokenizer: model {name!r} is not one of the recipe's models ("
            + ", ".join(sorted(known)) + ")"
            for name in dict.fromkeys(recipe.tokenizer.models_named()) if name not in known]


def own_setting_problems(recipe: MergeRecipe) -> list[str]:
    """A model's own parameter that no method of the merge block reads per model, and a
    negative weight where a method's maths takes none."""
    methods = [REGISTRY[m] for m in sorted(recipe.merge.methods)]
    per_model = {n for m in methods for n in m.per_model}
    unsigned = [m.name for m in methods if m.weights and m.target and not m.signed_weights]
    problems = []
    for where, model in merge_inputs(recipe):
        for name in sorted(set(model.own()) - per_model):
            readers = [m.name for m in REGISTRY.values() if name in m.per_model]
            problems.append(f"{where}.{name}: not read per model by "
                            f"{', '.join(m.name for m in methods)} (a per-model {name} is "
                            f"read by {', '.join(readers)})")
        negative = [v for v in setting_values(model.weight) if v < 0]
        if negative and unsigned:
            problems.append(f"{where}.weight: {negative[0]:g} is negative; {', '.join(unsigned)} "
                            "cannot take a negative weight (signed weights: " + ", ".join(
                                m.name for m in REGISTRY.values() if m.signed_weights) + ")")
    return problems



MergeRecipe.model_rebuild()
