"""The pieces every recipe kind shares: strict models, model references (with their LoRA
adapters and experts), merge inputs, calibration text, routers' and output settings, and the
base class of every recipe with the validators all kinds run.

No torch import here: a recipe can be validated without loading any tensor library.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    ConfigDict,
    Field,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from moemerge.bounds import MAX_EXPERTS, MAX_MODELS, MAX_SEQ_LEN, MAX_TOKENS
from moemerge.merge.registry import all_params, per_model_params
from moemerge.recipe.merge import Setting, as_conditions, setting_problem
from moemerge.recipe.unquoted import UnquotedNumbers

OutputDType = Literal["auto", "float32", "float16", "bfloat16"]


def refs_from_str(value):
    """Let a model reference, or a list of them, be a plain string: shorthand for `{model: ...}`."""
    if isinstance(value, str):
        return {"model": value}
    if isinstance(value, list):
        return [{"model": v} if isinstance(v, str) else v for v in value]
    return value


# the list fields counted before their entries are validated (a million experts are refused
# at once): (noun, bound); llama.cpp's own bound is finish/gguf.py's LLAMA_CPP_MAX_EXPERTS
COUNTED = {"experts": ("experts", MAX_EXPERTS), "models": ("models", MAX_MODELS),
           "slices": ("slices", MAX_MODELS), "sources": ("sources", MAX_MODELS)}


def at_most(value: object, info: ValidationInfo) -> object:
    """A list field of COUNTED with more entries than its bound is refused before any entry is
    validated or any model resolved."""
    noun, bound = COUNTED[info.field_name]
    if isinstance(value, list) and len(value) > bound:
        raise ValueError(f"{len(value):,} {noun}; a recipe lists at most {bound} {noun}"
                         + (" (llama.cpp loads at most 1024)" if noun == "experts" else ""))
    return value


class Strict(UnquotedNumbers):
    # every float must be finite: a NaN lambda or an infinite weight builds a NaN model
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelRef(Strict):
    """A dense checkpoint: a local directory or a hub id (`org/name`), optional revision."""

    model: str = Field(min_length=1, description=(
        "A local directory (relative paths are looked up next to the recipe first) or a hub id "
        "(org/name)."))
    revision: str | None = Field(default=None, description="A hub revision (branch, tag, "
                                 "commit) of a hub id.")
    weight: float = Field(default=1.0, ge=0.0, description="Weight in non-FFN merges.")
    expert: int | None = Field(default=None, ge=0, description=(
        "An expert of a token-routed MoE, by index from 0: that expert as a dense model of the "
        "family the MoE is built from (its FFN with the MoE's attention, norms, embedding and "
        "head; what `moemerge extract` writes), read in place."))
    lora: str | None = Field(default=None, min_length=1, description=(
        "A PEFT LoRA adapter applied to the model (docs/lora.md): a directory (relative paths "
        "are looked up next to the recipe first) or a hub id. Each targeted weight is read as "
        "W + s·B·A, streamed per tensor; `model: base+adapter` (mergekit's spelling) is the "
        "same."))
    lora_revision: str | None = Field(default=None, description="A hub revision of a hub id "
                                      "`lora`.")

    @model_validator(mode="before")
    @classmethod
    def _adapter_spelling(cls, data: object) -> object:
        """`model: base+adapter` is `{model: base, lora: adapter}`; with `lora` given (even
        null) `model` is taken as written (a directory whose name holds a `+`)."""
        if not (isinstance(data, dict) and isinstance(data.get("model"), str)
                and "+" in data["model"] and "lora" not in data):
            return data
        base, _, adapter = data["model"].partition("+")
        if not base or not adapter or "+" in adapter:
            raise ValueError(f"model: {data['model']!r}: a model with a LoRA adapter is "
                             "base+adapter (one '+'), or {model: base, lora: adapter}")
        return {**data, "model": base, "lora": adapter}

    @model_validator(mode="after")
    def _lora_revision_needs_lora(self):
        if self.lora_revision is not None and self.lora is None:
            raise ValueError("lora_revision: given without a `lora` adapter")
        return self


class _MergeInput(ModelRef):
    @model_validator(mode="before")
    @classmethod
    def _global_only(cls, data: object) -> object:
        """A merge parameter that no method reads per model (lambda, t, ...) is refused with
        where it goes instead, not as an unknown field."""
        if isinstance(data, dict):
            misplaced = sorted(set(data) & set(all_params()) - set(per_model_params()))
            if misplaced:
                raise ValueError(f"{', '.join(misplaced)}: not a per-model parameter (one value "
                                 "for all models): set it in the `merge` block, or per tensor in "
                                 "`merge.overrides`")
        return data

    def own(self) -> dict[str, object]:
        """The settings this model gives itself: {parameter: setting}, weight excluded."""
        return {n: getattr(self, n) for n in per_model_params() if getattr(self, n) is not None}


def _check_setting(cls, value, info):
    problem = setting_problem(info.field_name, value)
    if problem:
        raise ValueError(problem)
    return value


_SETTINGS = ("weight", *per_model_params())
MergeInput = create_model(
    "MergeInput", __base__=_MergeInput, __doc__="A model merged by `kind: merge` (an entry of "
    "`models`, or a slice source) and its own parameters: a number, a per-layer gradient or "
    "conditions selecting tensors; the model's own value wins over the merge block's "
    "(docs/recipes.md#per-model-parameters).",
    __validators__={"_conditions": field_validator(*_SETTINGS, mode="before")(as_conditions),
                    "_ranges": field_validator(*_SETTINGS)(_check_setting)},
    weight=(Setting, Field(default=1.0, description="Weight in the merge (signed where the "
                                                    "method allows it).")),
    **{name: (Setting | None, Field(default=None, description=f"This model's own {p.doc}."))
       for name, p in per_model_params().items()},
)


class ExpertRef(ModelRef):
    name: str | None = Field(default=None, description="Display name; defaults to the dir name.")
    positive_prompts: list[str] = Field(default_factory=list, description=(
        "Text this expert should be routed (router.init: prompts)."))
    negative_prompts: list[str] = Field(default_factory=list, description=(
        "Text it should not be routed (subtracted under router.init: prompts)."))


class RoutedExpertRef(ExpertRef):
    """An expert of `kind: moe` (token_routed) or its shared expert: its FFN may be changed
    on the way in, as mergekit-moe's expert options do."""

    noise_scale: float = Field(default=0.0, ge=0.0, description="Std of Gaussian noise added "
                               "to its FFN weights (seeded from the recipe's seed and the "
                               "tensor's name).")
    residual_scale: float = Field(default=1.0, description="Its FFN's output scaled by this "
                                  "(its down projection multiplied).")


class CalibrationText(Strict):
    """Calibration text: where it is and how much of it is read, in windows of seq_len."""

    data: list[str] = Field(min_length=1, description="Text in the forms `finetune --data` "
                            "reads (paths relative to the recipe): one text per expert, each "
                            "domain named after its expert (`name=path`, or a directory of "
                            "files named after the experts), or one mixed text whose targets "
                            "are the experts' per-token losses.")
    max_tokens: int = Field(default=4096, gt=0, le=MAX_TOKENS, description="Tokens read per "
                            "domain.")
    seq_len: int = Field(default=128, gt=1, le=MAX_SEQ_LEN, description="Tokens per calibration "
                         "window.")
    text_field: str = Field(default="text", min_length=1, description="Field of .jsonl "
                            "records holding the text.")

    _one_or_many = field_validator("data", mode="before")(
        lambda v: [v] if isinstance(v, str) else v)


class CalibrationSpec(CalibrationText):
    """Calibration text for `router.init: calibrate` (docs/routing.md): routers set in closed
    form by ridge regression from the merged model's router inputs to expert targets."""

    targets: Literal["auto", "domain", "loss"] = Field(
        default="auto", description="domain: one-hot of the text's expert; loss: softmax of "
        "the negative per-token expert losses; auto: domain when every text names an expert, "
        "loss for one text.")
    confidence: Annotated[float, Field(gt=0.0, lt=1.0)] | Literal["fit"] = Field(
        default=0.8, description="Mean top-1 routing probability the routers are scaled to on "
        "the calibration data; fit: each router's scale fitted to the targets of held-out "
        "windows (temperature scaling).")


def calibration_problem(calibrates: bool, calibration: CalibrationSpec | None,
                        num_experts: int, init_field: str = "router.init") -> str | None:
    """The error of a calibrate init without calibration data, or of data nothing reads."""
    if calibrates and calibration is None:
        return f"{init_field}: 'calibrate' needs a `calibration: {{data: ...}}` block"
    if not calibrates and calibration is not None:
        return f"calibration: given, but {init_field} is not 'calibrate' (nothing would read it)"
    if calibration is not None and calibration.confidence != "fit" \
            and calibration.confidence <= 1 / num_experts:
        return (f"calibration.confidence: {calibration.confidence} is not above 1/{num_experts} "
                "(the top-1 probability of uniform routing)")
    return None


# mergekit-moe's gate modes, computed as it computes them (routing/prompts.py)
MERGEKIT_INITS = ("mergekit_hidden", "mergekit_hidden_avg", "mergekit_cheap_embed")
# router inits that read every expert's positive_prompts
PROMPTED = ("prompts", "cheap_embed", *MERGEKIT_INITS)


class RouterSpec(Strict):
    init: Literal["random", "uniform", "prompts", "cheap_embed", "task_vector", "calibrate",
                  "mergekit_hidden", "mergekit_hidden_avg", "mergekit_cheap_embed"] = Field(
        default="random", description="random (N(0, std²)); uniform (U(-1/√H, 1/√H): "
        "nn.Linear's default, mergekit-moe's uniform_random); prompts / cheap_embed: the "
        "experts' prompts' "
        "mean router input / embedding, centred across experts; task_vector; calibrate "
        "(docs/routing.md); mergekit_hidden, mergekit_hidden_avg, mergekit_cheap_embed: "
        "mergekit-moe's gate modes, computed as it does (docs/mergekit.md).")
    std: float | None = Field(default=None, gt=0.0, description="Std of random init.")
    max_prompt_tokens: int = Field(default=512, gt=0, le=MAX_SEQ_LEN, description=(
        "Tokens of each prompt read by the prompts init."))


class OutputSpec(Strict):
    dtype: OutputDType = Field(default="auto", description=(
        "The output's dtype; auto: the base's (else the first model's)."))
    max_shard_size: str | int = Field(default="5GB", description=(
        "Largest safetensors shard, in bytes or with a unit (5GB, 500MB)."))
    experts: Literal["classic", "fused"] = Field(default="classic", description=(
        "How a token-routed MoE's experts are stored. classic: one tensor per expert and "
        "projection (experts.0.w1.weight ...), what llama.cpp's converter, vLLM and "
        "transformers 4 read. fused: transformers 5's stacks (experts.gate_up_proj [E, 2I, H], "
        "experts.down_proj [E, H, I]), what mergekit 0.1.5 writes; needs transformers >= 5."))


class RecipeBase(Strict):
    name: str | None = Field(default=None, description="The model's name (the card's title).")
    seed: int = Field(default=0, description=(
        "Seeds everything random (DARE / DELLA draws, random routers): the same recipe gives "
        "the same bytes."))
    output: OutputSpec = Field(default=OutputSpec(), description="dtype and shard size.")

    # one validator for the model fields of every recipe kind (check_fields: not all have all)
    _model_refs = field_validator(
        "base_model", "models", "experts", mode="before", check_fields=False
    )(refs_from_str)
    _counted = field_validator("models", "experts", "slices", mode="before",
                               check_fields=False)(at_most)

    @model_validator(mode="before")
    @classmethod
    def _calibrate_by_default(cls, data: object) -> object:
        """An MoE recipe with a `calibration` block and no `router.init` calibrates its routers
        (the block is read by nothing else); a learned router is the one that can be set."""
        if not (isinstance(data, dict) and data.get("kind") == "moe" and data.get("calibration")):
            return data
        router = data.get("router") or {}
        if isinstance(router, dict) and "init" not in router and \
                router.get("kind", "learned") == "learned":
            return {**data, "router": {**router, "init": "calibrate"}}
        return data

    @model_validator(mode="after")
    def _inputs_usable(self):
        """Weights that can be normalised, and expert names that tell experts apart."""
        field = "models" if hasattr(self, "models") else "experts"
        refs = getattr(self, field, None) or []
        plain = all(isinstance(r.weight, float | int) and r.weight >= 0 for r in refs)
        if refs and plain and sum(r.weight for r in refs) <= 0:
            raise ValueError(f"{field}: the weights sum to 0; give at least one model a weight "
                             "above 0")
        names = [r.name for r in refs if getattr(r, "name", None) is not None]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"{field}: expert name(s) {', '.join(map(repr, twice))} given "
                             "more than once; each expert needs its own name")
        return self
