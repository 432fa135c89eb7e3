"""The options of `extend` and `extract`: one model each, the source of every flag of the command
(cli/extend.py and cli/extract.py declare each from its field's description, as `build` does
from BuildOptions) and of the checks the flags need together. Light: no torch."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

LORA_FORMS = "RANK|auto|stored"


class ExtendOptions(BaseModel):
    """`moemerge extend MOE OUT --expert ...` (built/extend/command.extend_moe)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    expert: list[Path] = Field(min_length=1, description=(
        "A dense model fine-tuned from the MoE's base (repeat for several); its FFN joins every "
        "layer as a new expert (seq_routed: its whole decoder stack; merged_experts: its FFN "
        "weights join every layer's experts)."))
    name: list[str] | None = Field(None, description=(
        "The new expert's name, one per --expert in order (default: its directory's name)."))
    calibration: list[str] | None = Field(None, description=(
        "The new expert's calibration text, NAME=PATH (or a bare PATH per --expert in order), "
        "in the forms `finetune --data` reads. Without --recalibrate only this text runs "
        "through the model. Only for calibrated routers. For an MoE moemerge did not build, "
        "also the text its own experts keep, moe=PATH."))
    recalibrate: bool = Field(False, description=(
        "Exact: calibrate every router again, layer by layer as `build` does, on all the "
        "calibration text (the recipe copy's, which must still exist, and the new experts'): "
        "the routers a rebuild gets, for the old text's forwards. Without it, only layer 0's "
        "router is a rebuild's; deeper ones are fitted on the old model's hidden states. "
        "Needed for a calibrated seq_routed or merged_experts router (build keeps no "
        "statistics for them). Implied where the shared tensors are merged again (see "
        "--keep-shared)."))
    keep_shared: bool = Field(False, description=(
        "Keep the shared tensors as built (token_routed and merged_experts: attention, norms, "
        "embedding and head; seq_routed: the embedding and head not kept per expert): the old "
        "experts compute as before and the new ones join the recipe copy with weight 0. "
        "Without it, where the recipe's merge reads every expert (any method but `base`, or "
        "shared_expert: average), they are merged again with the new experts as a rebuild "
        "merges them (the base and old experts are read where the recipe copy names them) and "
        "calibrated routers are calibrated again on all the text."))
    force: bool = Field(False, description="Replace OUTPUT if it exists.")


class ExtractOptions(BaseModel):
    """`moemerge extract MODEL OUT ...` (built/extract: a dense expert, or with --lora an
    adapter)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    expert: str | None = Field(None, description=(
        "The expert to extract: its name as the recipe gives it (or the name of its "
        "directory), or its index from 0. A wrong name lists the valid ones."))
    weights: str | None = Field(None, description=(
        "merged_experts only, instead of --expert: routing scores w1,w2,... (one per expert, "
        "normalised to sum 1); every FFN is merged at them, W = E_m + α Σ s_i Δ_i."))
    lora: str | None = Field(None, description=(
        "Extract a PEFT LoRA adapter instead (needs --base): each attention / FFN linear that "
        "differs from the base's as the truncated SVD of its task vector at this rank (at most "
        "the matrix's smaller side), or `auto`: per module, the smallest rank keeping "
        "--lora-share of the task vector's energy. Other modules that differ (embedding, head, "
        "norms, a changed bias) are kept whole in modules_to_save; equal ones are left out. "
        "`stored`: an MoE of LoRA experts' expert as the adapter it stores, exactly (no SVD; "
        "--base optional, it only names the base in adapter_config.json)."))
    lora_share: float | None = Field(None, description=(
        "With --lora auto: the share of each module's task-vector energy (squared Frobenius "
        "norm: Σ s_i² of the kept singular values over that of all) the rank keeps, in "
        "(0, 1]; default 0.9."))
    base: str | None = Field(None, description=(
        "With --lora: the dense model the adapter is for (a directory or a hub id; named in "
        "adapter_config.json as base_model_name_or_path). For an MoE's expert, the base its "
        "experts were fine-tuned from (the recipe's base_model)."))
    device: str = Field("cpu", description="With --lora: where the SVDs run (cpu, cuda, "
                        "cuda:N).")
    force: bool = Field(False, description="Replace OUTPUT if it exists.")

    @property
    def stored(self) -> bool:
        """--lora stored: the adapter an MoE of LoRA experts stores, as it is."""
        return self.lora is not None and self.lora.strip().lower() == "stored"

    @property
    def rank(self) -> int | None:
        """--lora RANK as a number; None for auto, stored or no --lora."""
        given = (self.lora or "").strip()
        return int(given) if given.isdigit() else None

    @model_validator(mode="after")
    def _lora_flags_together(self) -> ExtractOptions:
        """The flags that go with --lora, and its forms."""
        if self.lora is None:
            if self.base is not None or self.lora_share is not None or self.device != "cpu":
                raise ValueError(f"--base, --lora-share and --device go with --lora "
                                 f"{LORA_FORMS.replace('|stored', '')}")
            return self
        form = self.lora.strip().lower()
        if form == "stored":
            return self
        if self.base is None:
            raise ValueError("--lora: give --base BASE, the dense model the adapter goes on "
                             "(for an MoE's expert, the base its experts were fine-tuned from)")
        if form == "auto":
            if self.lora_share is not None and not 0 < self.lora_share <= 1:
                raise ValueError(f"--lora-share {self.lora_share:g}: give a share in (0, 1], "
                                 "e.g. 0.9")
        elif self.lora_share is not None:
            raise ValueError("--lora-share goes with --lora auto; --lora RANK fixes the rank")
        elif not form.isdigit() or int(form) < 1:
            raise ValueError(f"--lora {self.lora!r}: give a rank (a whole number from 1), "
                             "`auto` or `stored`")
        return self
