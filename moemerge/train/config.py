"""The finetune settings: one strict pydantic model, from a YAML file and/or CLI options.

Unknown or misspelt keys are errors; every error is reported at once and names the field and
where it came from (the file, or the command line).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from moemerge.bounds import MAX_BATCH_SIZE, MAX_SEQ_LEN
from moemerge.errors import RecipeError
from moemerge.recipe.load import safe_yaml

Part = Literal["routers", "experts", "projectors", "curvature", "all"]
# finetune's step budget when neither --steps nor --epochs is given (was one epoch: 526 steps,
# 5 min on the toy MoE's 1 MB per domain, for a 0.3 % perplexity gain). On recipes/toy_moe.yaml
# (calibrated routers) 200 router-only steps give 48.91 -> 48.82 in 34 s, 300 give 48.79 (README)
DEFAULT_STEPS = 200


class TrainConfig(BaseModel):
    """Every field of `moemerge finetune` (CLI option `--seq-len` is field `seq_len`)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    model: str = Field(min_length=1, description="MoE model directory to train.")
    output: str = Field(min_length=1, description="Output model directory (written atomically).")
    data: list[str] = Field(min_length=1, description="Training text: a file, directory, JSONL, "
                            "saved or hub dataset, or name=path (docs/data.md); repeat.")
    train: list[Part] = Field(default=["routers"], min_length=1, description="What to train, "
                              "comma-separated: routers (the default), experts (the "
                              "routed experts' FFNs: with routers, BTX's post-merge training), "
                              "projectors, curvature, or all.")
    seq_len: int = Field(default=256, ge=2, le=MAX_SEQ_LEN, description="Tokens per block.")
    eval_fraction: float = Field(default=0.1, ge=0.0, lt=1.0, description="Held-out share of "
                                 "each domain's blocks (a domain without held-out files).")
    text_field: str = Field(default="text", description="JSONL data: the field holding the text.")
    label_field: str = Field(default="domain", description="JSONL data: the field naming each "
                             "record's domain, when the records have one.")
    batch_size: int = Field(default=8, ge=1, le=MAX_BATCH_SIZE, description="Blocks per "
                            "optimizer step over all processes.")
    grad_accum: int = Field(default=1, ge=1, description="Micro-batches per optimizer step.")
    steps: int | None = Field(default=None, ge=1, description=f"Optimizer steps; default: "
                              f"{DEFAULT_STEPS} (with the default --batch-size and --seq-len, "
                              f"{DEFAULT_STEPS * 8 * 256:,} tokens), or --epochs when given.")
    epochs: float | None = Field(default=None, gt=0.0, description="Passes over the training "
                                 "blocks instead of a number of steps, when no --steps.")
    lr: float = Field(default=1e-3, gt=0.0, description="Peak learning rate.")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW weight decay.")
    schedule: Literal["cosine", "linear", "constant"] = Field(
        default="cosine", description="Learning-rate schedule: cosine, linear or constant.")
    warmup_steps: int | None = Field(default=None, ge=0, description="Warm-up steps; default: "
                                     "10% of the steps.")
    max_grad_norm: float = Field(default=1.0, ge=0.0, description="Gradient clipping norm; 0 "
                                 "disables clipping.")
    aux_loss_coef: float | None = Field(
        default=None, ge=0.0, description="Load-balancing loss coefficient; default: 0.04 / "
        "top-k for an upcycled model whose routers train (train/aux_loss.py), else 0.")
    eval_every: int = Field(default=0, ge=0, description="Evaluate every N steps; 0: at the "
                            "end only.")
    seed: int = Field(default=0, description="Seed of the data order and the RNG.")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto, cpu or "
                                                   "cuda.")
    autocast: Literal["auto", "off", "bf16"] = Field(
        default="auto", description="Mixed-precision forwards: auto = bf16 on CUDA, none on "
        "the CPU; bf16 = on either; off = float32.")
    save_every: int = Field(default=0, ge=0, description="Checkpoint into OUT.checkpoints/ "
                            "every N steps; 0: never.")
    keep_checkpoints: int = Field(default=2, ge=1, description="Checkpoints kept.")
    resume: bool = Field(default=False, description="Continue from the latest checkpoint.")
    force: bool = Field(default=False, description="Replace OUT if it exists.")
    fsdp: bool = Field(default=False, description="Under torchrun: shard parameters, gradients "
                       "and optimizer states over the processes (FSDP), not DDP.")
    gradient_checkpointing: bool = Field(
        default=False, description="Recompute each decoder layer's activations in the backward "
        "pass instead of keeping them: less memory, about a third more time per step.")
    trust_remote_code: bool = Field(default=False, description="Run Python shipped in the "
                                    "model directory (not moemerge's kinds, which use the "
                                    "installed code). Only for models you trust.")

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if "all" in self.train and len(self.train) > 1:
            raise ValueError("train: 'all' (--full) trains everything; do not combine it")
        if len(set(self.train)) != len(self.train):
            raise ValueError("train: a part is named twice")
        return self

    def total_steps(self, train_blocks: int) -> int:
        """The run's optimizer steps: `steps`, `epochs` passes over `train_blocks`, or
        DEFAULT_STEPS."""
        if self.steps is not None:
            return self.steps
        if self.epochs is not None:
            return max(1, math.ceil(self.epochs * train_blocks / self.batch_size))
        return DEFAULT_STEPS

    def fingerprint(self) -> dict:
        """The fields that decide the training trajectory (a resume must match them)."""
        skip = {"output", "resume", "force", "save_every", "keep_checkpoints", "device",
                "gradient_checkpointing"}  # recomputation gives the same gradients
        return self.model_dump(exclude=skip)


def field_default(name: str) -> str | None:
    """A field's default as `--help` shows it, or None when it has no plain one."""
    info = TrainConfig.model_fields[name]
    if info.is_required() or not isinstance(info.default, (int, float, str)) or \
            isinstance(info.default, bool):
        return None
    return str(info.default)


def _describe(err: dict, cli: bool) -> str:
    field = ".".join(str(p) for p in err["loc"])
    if cli and field:
        field = f"{field} (--{field.split('.')[0].replace('_', '-')})"
    if err["type"] == "extra_forbid" or err["type"] == "extra_forbidden":
        return f"{field}: unknown field (misspelt, or not valid here)"
    if err["type"] == "missing":
        return f"{field}: missing"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{field}: {msg}" if field else msg


def make_config(file: Path | None, overrides: dict) -> TrainConfig:
    """Validate YAML `file` (optional) updated with CLI `overrides` (None values dropped)."""
    data: dict = {}
    if file is not None:
        if not Path(file).is_file():
            raise RecipeError(f"{file}: config file not found")
        try:
            text = Path(file).read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RecipeError(f"{file}: cannot read it as UTF-8 text: {exc}") from None
        loaded = safe_yaml(text, str(file))
        if not isinstance(loaded, dict):
            raise RecipeError(f"{file}: a finetune config is a mapping of fields")
        data = dict(loaded)
    data |= {k: v for k, v in overrides.items() if v is not None}
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        errors = [_describe(e, cli=file is None) for e in exc.errors()]
        noun = "error" if len(errors) == 1 else "errors"
        lines = "\n".join(f"  - {e}" for e in errors)
        where = file or "<command line>"
        raise RecipeError(f"{where}: {len(errors)} config {noun}:\n{lines}") from None
