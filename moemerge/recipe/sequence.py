"""Recipe schema of the sequence-routed MoE kinds: `assembly: seq_routed` and `assembly: bridged`.

Both route whole sequences (one decision per sequence, top `experts_per_sequence` experts) and
ship their own modeling code; see moemerge/modeling/.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from moemerge.bounds import MAX_SEQ_LEN
from moemerge.recipe.base import (
    CalibrationSpec,
    ExpertRef,
    ModelRef,
    RecipeBase,
    Strict,
    calibration_problem,
)
from moemerge.recipe.merge import MergeSpec, method_problems

SharedRole = Literal["embed", "lm_head"]


class SeqRouterSpec(Strict):
    """How sequences are routed. `learned` is a linear router on the mean token embedding
    (initialised here, trained with `moemerge finetune`); `perplexity` and `task_vector` need
    no training."""

    kind: Literal["learned", "perplexity", "task_vector"] = "learned"
    init: Literal["random", "prompts", "calibrate"] = Field(
        default="random", description="Init of a learned router: random, each expert's "
        "prompts' mean embedding (centred across experts, unit rows), or calibrate (ridge "
        "regression on `calibration` data, docs/routing.md).")
    std: float | None = Field(default=None, gt=0.0, description="Std of random init.")
    max_prompt_tokens: int = Field(default=512, gt=0, le=MAX_SEQ_LEN)
    temperature: float = Field(default=1.0, gt=0.0, description="Softmax temperature over the "
                               "top-k routing scores.")
    task_vector_params: list[str] = Field(
        default_factory=lambda: ["layers."], min_length=1,
        description="Substrings of the parameter names whose task vectors task_vector routing "
        "compares with the base model's gradient.")


class ProjectorSpec(Strict):
    """Bridged experts' proj-in (d_m → d_i) and proj-out (d_i → d_m): y = L x + D silu(U x)."""

    init: Literal["auto", "identity", "lstsq", "random"] = Field(
        default="auto", description="auto: identity for a lone expert (exact), lstsq for "
        "several. identity: L selects (pads) the expert's own d_i "
        "coordinates and D = 0, so an expert alone reproduces its dense model. lstsq: L is the "
        "least-squares map from the shared embedding to the expert's own (proj-in) and the one "
        "that makes the shared head give the expert's logits (proj-out), D = 0: the best "
        "linear start when several experts share the embedding.")
    hidden_size: int = Field(default=0, ge=0, description="Width of the MLP branch (U, D); 0 "
                             "makes the projectors linear.")
    std: float | None = Field(default=None, gt=0.0, description="Std of random weights; "
                              "default 1/sqrt(d_in) for L, initializer_range for U and D.")


class _SequenceRecipe(RecipeBase):
    kind: Literal["moe"]
    experts: list[ExpertRef] = Field(min_length=1)
    experts_per_sequence: int = Field(default=1, ge=1)
    router: SeqRouterSpec = SeqRouterSpec()
    calibration: CalibrationSpec | None = None

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def _common_checks(self) -> None:
        if self.experts_per_sequence > self.num_experts:
            raise ValueError(f"experts_per_sequence: {self.experts_per_sequence} is larger than "
                             f"the number of experts ({self.num_experts})")
        if self.router.kind == "learned" and self.router.init == "prompts":
            missing = [e.name or e.model for e in self.experts if not e.positive_prompts]
            if missing:
                raise ValueError("router.init: 'prompts' needs positive_prompts for every "
                                 "expert; missing for " + ", ".join(missing))
        calibrates = self.router.init == "calibrate"
        if calibrates and self.router.kind != "learned":
            raise ValueError(f"router.init: 'calibrate' sets a learned router's weights; "
                             f"router.kind is {self.router.kind!r}")
        if problem := calibration_problem(calibrates, self.calibration, self.num_experts):
            raise ValueError(problem)


class SeqRoutedRecipe(_SequenceRecipe):
    """Homogeneous experts with separate attention: each expert keeps its whole decoder stack;
    embeddings and head are merged (`merge`) unless listed in `per_expert`."""

    assembly: Literal["seq_routed"]
    base_model: ModelRef | None = Field(default=None, description="Needed by merge methods "
                                        "with a base and by task_vector routing.")
    merge: MergeSpec = MergeSpec()
    per_expert: list[SharedRole] = Field(default_factory=list, description="Roles each expert "
                                         "keeps its own copy of instead of a merged one.")
    mix: Literal["logits", "hidden"] = "logits"

    @model_validator(mode="after")
    def _consistent(self) -> SeqRoutedRecipe:
        self._common_checks()
        problems = method_problems(self.merge, len(self.experts),
                                   has_base=self.base_model is not None, moe=True)
        if problems:
            raise ValueError("; ".join(problems))
        if self.router.kind == "task_vector" and self.base_model is None:
            raise ValueError("base_model: router kind 'task_vector' needs the base model "
                             "(the experts' task vectors are measured from it)")
        other = sorted({r for o in self.merge.overrides for r in o.roles or []}
                       - {"embed", "lm_head"})
        if other:
            raise ValueError(f"merge.overrides: role(s) {', '.join(other)} are never merged in "
                             "seq_routed (each expert keeps its own); only embed and lm_head are")
        if self.mix == "hidden" and "lm_head" in self.per_expert:
            raise ValueError("mix: 'hidden' mixes hidden states before one shared head, but "
                             "per_expert keeps a head per expert; use mix: logits")
        return self


class BridgedRecipe(_SequenceRecipe):
    """Heterogeneous experts (other widths, depths, families) bridged by projectors around a
    shared embedding and head of the widest expert's width."""

    assembly: Literal["bridged"]
    tokenizer: str | None = Field(default=None, description="The expert (its name, or its "
                                  "`model` as written) whose tokenizer the MoE keeps; default "
                                  "the first. Experts with another vocabulary are mapped onto "
                                  "it by token string.")
    projectors: ProjectorSpec = ProjectorSpec()
    mix: Literal["logits", "hidden"] = "hidden"

    @model_validator(mode="after")
    def _consistent(self) -> BridgedRecipe:
        self._common_checks()
        if self.router.kind == "task_vector":
            raise ValueError("router.kind: 'task_vector' needs experts branched from one base; "
                             "bridged experts have none. Use learned or perplexity")
        if self.tokenizer is not None and self.tokenizer_index is None:
            names = [e.name or e.model for e in self.experts]
            raise ValueError(f"tokenizer: {self.tokenizer!r} is not an expert's name or model "
                             f"({', '.join(names)})")
        return self

    @property
    def tokenizer_index(self) -> int | None:
        """Which expert's tokenizer the MoE keeps: `tokenizer` matched against the experts'
        names, then their `model` references; 0 when unset; None when nothing matches."""
        if self.tokenizer is None:
            return 0
        for key in ("name", "model"):
            found = [i for i, e in enumerate(self.experts) if getattr(e, key) == self.tokenizer]
            if found:
                return found[0]
        return None
