"""An MoE of LoRA experts' expert: the base with its adapter merged (a dense model), or the
adapter itself (`--lora stored`: a PEFT adapter directory, its factors as the MoE stores them).

The MoE stores, per targeted module, A [E, R, I] and s·B [E, O, R] (its scale folded in, ranks
below R zero-padded). Expert e's dense weight is W + B_e A_e computed in float32 and cast to
W's dtype, as peft's `merge_and_unload()` adds a float32 delta. As an adapter, each module's
rank is R less the trailing zero rows padding added (a rank the adapter had), and its scale is
1 (lora_alpha = r per module), so peft computes the same B A."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from moemerge.architectures.config import dense_config
from moemerge.io.adapter import CONFIG_FILE, PREFIX, SAFETENSORS_FILE
from moemerge.io.reader import CheckpointReader
from moemerge.io.tensor_list import DenseTensor, Extraction, config_dtype
from moemerge.loading import read_recipe_copy


def is_lora_part(name: str) -> bool:
    """The MoE's own tensors: the stacked factors and the routers."""
    return name.endswith((".lora_A", ".lora_B", ".router.weight"))


def extract_lora_expert(reader: CheckpointReader, config: dict, expert: int,
                        label: str) -> Extraction:
    """Expert `expert` as the dense base with its adapter merged."""
    extraction = Extraction(dense_config(config["base"], config_dtype(config)))
    extraction.config["tie_word_embeddings"] = bool(config.get("tie_word_embeddings"))
    for name in reader.names():
        module = name.removesuffix(".weight")
        if is_lora_part(name):
            continue
        if module not in config["lora_ranks"]:
            extraction.copy(reader, name)
            continue
        meta = reader.meta(name)

        def merged(name=name, module=module) -> torch.Tensor:
            weight = reader.read(name)
            delta = (reader.read(f"{module}.lora_B")[expert].float()
                     @ reader.read(f"{module}.lora_A")[expert].float())
            return (weight.float() + delta).to(weight.dtype)

        extraction.tensors.append(DenseTensor(name, meta.dtype, meta.shape, merged))
    extraction.what = (f"expert {expert} ({label!r}) of an MoE of LoRA experts: the base with "
                       "that adapter merged into its weights")
    return extraction


def stored_adapter(reader: CheckpointReader, config: dict, expert: int) -> tuple[dict, dict]:
    """(adapter_config.json, {PEFT tensor name: factor}) of expert `expert`; modules the
    expert's adapter left alone (all-zero factors) are not targeted."""
    tensors, ranks = {}, {}
    for module in config["lora_ranks"]:
        a = reader.read(f"{module}.lora_A")[expert].float()  # [R, I]
        b = reader.read(f"{module}.lora_B")[expert].float()  # [O, R]
        used = (a.abs().sum(1) + b.abs().sum(0)).nonzero()
        if not len(used):
            continue
        r = int(used.max()) + 1  # the padded rows are the trailing ones
        ranks[module] = r
        tensors[f"{PREFIX}{module}.lora_A.weight"] = a[:r].contiguous()
        tensors[f"{PREFIX}{module}.lora_B.weight"] = b[:, :r].contiguous()
    r = max(ranks.values(), default=1)
    leaves = sorted({m.rsplit(".", 1)[1] for m in ranks})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": r,
        "target_modules": leaves, "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
        "fan_in_fan_out": False, "init_lora_weights": True,
        # every module at its own rank with scale 1: lora_alpha = r (peft matches these
        # patterns against the module's full name, so the full name selects that one module)
        "rank_pattern": {re.escape(m): k for m, k in ranks.items() if k != r},
        "alpha_pattern": {re.escape(m): k for m, k in ranks.items() if k != r},
        "base_model_name_or_path": None,
    }
    return adapter_config, tensors


def write_stored_adapter(moe: Path, tmp: Path, expert: int, base: str | None) -> int:
    """Write expert `expert`'s adapter into `tmp`, naming `base` (default: the base_model of
    the recipe copy) as its base; returns the number of modules."""
    with CheckpointReader(moe) as reader:
        adapter_config, tensors = stored_adapter(reader, reader.config, expert)
    recipe_base = read_recipe_copy(moe).get("base_model")
    if isinstance(recipe_base, dict):
        recipe_base = recipe_base.get("model")
    adapter_config["base_model_name_or_path"] = base or recipe_base
    (tmp / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2) + "\n")
    save_file(tensors, tmp / SAFETENSORS_FILE, metadata={"format": "pt"})
    return len(tensors) // 2
