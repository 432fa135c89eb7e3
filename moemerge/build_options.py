"""What `build` does besides what the recipe says: one model, the API's argument and the source
of every `moemerge build` flag (cli/build.py declares each from its field's description, as
`finetune` does from TrainConfig). Light: no torch."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator
from pydantic.dataclasses import dataclass

from moemerge.bounds import MAX_SEQ_LEN, MAX_TOKENS
from moemerge.errors import RecipeError

Verify = Literal["auto", "full", "structure"]
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
MAX_TIMEOUT = 7 * 24 * 3600.0


def _numbers(value: object) -> object:
    """"0.3,0.5" (a flag's text) -> (0.3, 0.5); every value finite."""
    given = value
    if isinstance(value, str):
        try:
            value = tuple(float(x) for x in value.split(",") if x.strip())
        except ValueError:
            value = (math.nan,)
    if isinstance(value, list | tuple) and not all(
            isinstance(x, int | float) and math.isfinite(x) for x in value):
        raise ValueError(f"expected comma-separated numbers, all finite, got {str(given)[:80]!r}")
    return value


Numbers = Annotated[tuple[float, ...], BeforeValidator(_numbers)]


@dataclass(frozen=True)
class TuneOptions:
    """`build --tune-on`: choose λ and density per tensor role on held-out text (docs/tuning.md).
    The fields are the flags `--tune-on`, `--tune-lambdas`, ...; checked together by
    tune.check_options."""

    text: Path = Field(description=(
        "Held-out text (any --data source, docs/data.md): choose merge lambda and density per "
        "tensor role by its perplexity (a directory's domains weigh the same: the geometric mean "
        "of theirs), then build with them (docs/tuning.md)."))
    lambdas: Numbers = Field((0.3, 0.5, 0.7, 1.0),
                             description="Lambdas tried per role, comma-separated.")
    densities: Numbers = Field((0.5, 0.7, 0.9), description=(
        "Densities tried per role, comma-separated (for methods with a density)."))
    max_tokens: int = Field(8192, le=MAX_TOKENS, description="Tokens of the held-out text "
                            "scored per candidate.")
    seq_len: int = Field(64, le=MAX_SEQ_LEN, description="Window length when scoring.")
    budget: float | None = Field(None, gt=0, le=7 * 24 * 3600, description=(
        "Seconds the search may take: it stops before a candidate that would end past them "
        "(at the mean time per candidate so far), the roles not reached keeping the recipe's "
        "values. Default: the whole grid."))


class BuildOptions(BaseModel):
    """How to build, whatever the recipe: `api.build(recipe, out, BuildOptions(...))`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dry_run: bool = Field(False, description=(
        "Print every output tensor and how it is made; reads headers only, writes nothing."))
    force: bool = Field(False, description="Replace OUTPUT if it exists.")
    allow_pickle: bool = Field(False, description=(
        "Accept pickled .bin checkpoints (loaded with weights_only=True). Only for files you "
        "trust."))
    verify: Verify = Field("auto", description=(
        "Check of the output: 'full' loads it in transformers, 'structure' checks every "
        "tensor's name, shape and dtype; 'auto' does 'full' up to 2 GiB."))
    strict: bool = Field(False, description=(
        "NaN/Inf in an input tensor is an error, not a warning."))
    allow_non_finite: bool = Field(False, description=(
        "Write output tensors holding NaN/Inf (refused by default)."))
    workers: int = Field(1, description=(
        "Tensors merged at once, each on its own thread (the output's bytes do not depend on "
        "it)."))
    lookahead: int = Field(3, description=(
        "Tensors read ahead of the one being written: more overlaps reading with merging, and "
        "holds more in memory (see --dry-run)."))
    device: str = Field("cpu", description=(
        "Where the merge arithmetic runs: cpu, or cuda (reading and writing stay on the host)."))
    tune: TuneOptions | None = Field(None, description="Tune the merge first (--tune-on).")
    gguf: str | None = Field(None, description=(
        "Also write OUTPUT/model-TYPE.gguf with llama.cpp's converter; TYPE: "
        f"{', '.join(GGUF_TYPES[:-1])} or {GGUF_TYPES[-1]} (needs --llama-cpp or "
        "$LLAMA_CPP_DIR, and the [gguf] extra)."))
    llama_cpp: Path | None = Field(None, description=(
        "A llama.cpp checkout, or an unpacked llama-cpp-python sdist, whose "
        "convert_hf_to_gguf.py --gguf runs."))
    gguf_timeout: float | None = Field(None, description=(
        "Seconds llama.cpp's converter may run before it is stopped (default: 10 minutes, and "
        "10 more per GiB of weights)."))

    @field_validator("gguf_timeout")
    @classmethod
    def _a_time_limit(cls, value: float | None) -> float | None:
        if value is not None and not 0 < value <= MAX_TIMEOUT:
            raise ValueError(f"must be a number of seconds above 0 and at most {MAX_TIMEOUT:g} "
                             f"(a week), got {value!r}")
        return value

    @field_validator("workers", "lookahead")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be at least 1, got {value}")
        return value


def build_options(**values) -> BuildOptions:
    """BuildOptions from keyword values, a bad one a RecipeError naming its flag."""
    return options_of(BuildOptions, **values)


def options_of(model: type[BaseModel], **values):
    """A command's options model (its fields are its flags) from keyword values, a bad one a
    RecipeError naming its flag."""
    unknown = sorted(set(values) - set(model.model_fields))
    if unknown:  # a caller's mistake, not a user's
        raise TypeError(f"{model.__name__}: no option {', '.join(unknown)} (options: "
                        f"{', '.join(model.model_fields)})")
    try:
        return model(**values)
    except ValidationError as exc:
        raise RecipeError(_describe(exc.errors()[0])) from None


def tune_options(text: Path, **values) -> TuneOptions:
    try:
        return TuneOptions(text, **values)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise RecipeError(_describe({**error, "loc": ("tune", *error["loc"])})) from None


def _describe(error: dict) -> str:
    loc = [str(p) for p in error["loc"] if not isinstance(p, int)]  # (not a list's index)
    flag = "--" + "-".join(loc).replace("_", "-").replace("tune-text", "tune-on")
    message = error["msg"].removeprefix("Value error, ")
    if not loc:  # the whole model's check: its message names the flags
        return message[:400]
    if error["type"] == "literal_error":
        message = f"must be {error['ctx']['expected'].replace(chr(39), '')}, got {error['input']!r}"
    return f"{flag}: {message}"[:400]
