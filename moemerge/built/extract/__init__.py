"""`moemerge extract`: one expert of an MoE built by moemerge, written as a dense model.

Which kind the MoE is comes from its config.json (`model_type`): a transformers MoE class for
token_routed / upcycle (token_routed.py), `moemerge` for seq_routed (seq_routed.py),
`moemerge_merged` for merged_experts / CAMEx (merged.py). Each returns an `Extraction`; this
module writes it under the output rule: atomically, tensor by tensor (one tensor in memory),
with the tokenizer files, a card saying where it came from, and a load check.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from moemerge.analysis.routing import expert_labels
from moemerge.built.extract.choice import expert_index, routing_weights
from moemerge.errors import RecipeError
from moemerge.finish.verify import FULL_LOAD_LIMIT, check_loads
from moemerge.io.atomic import SIDE_FILES, atomic_output_dir, copy_side_files
from moemerge.io.reader import CheckpointReader, read_config
from moemerge.io.tensor_list import Extraction, write_order
from moemerge.io.writer import ShardedWriter, finite
from moemerge.recipe.kinds import Kind

__all__ = ["Extracted", "extract_expert", "extract_stored_adapter"]


@dataclass
class Extracted:
    label: str  # the expert's name, or the weights
    kind: str  # token_routed, seq_routed or merged_experts
    tensors: int
    bytes: int


def extract_expert(moe: Path, out: Path, *, expert: str | None = None,
                   weights: str | None = None, force: bool = False,
                   verify: bool = True) -> Extracted:
    """Write expert `expert` (a name or an index) of MoE `moe`, or (merged_experts) its FFNs
    merged at routing `weights` ("w1,w2,..."), to `out` as a dense model."""
    moe, out = Path(moe), Path(out)
    if (expert is None) == (weights is None):
        raise RecipeError("give --expert NAME (or an index), or --weights w1,w2,... "
                          "(merged_experts only), not both")
    config = read_config(moe)
    with CheckpointReader(moe) as reader:
        kind, extraction, label = choose_extraction(moe, reader, config, expert, weights)
        extraction.tensors.sort(key=write_order)
        size = sum(t.dtype.itemsize * math.prod(t.shape) for t in extraction.tensors)
        metadata = {"moemerge_extracted_from": str(moe.name), "moemerge_expert": label}
        with atomic_output_dir(out, force=force, size=size) as tmp:
            planned = [(t.name, t.dtype, t.shape) for t in extraction.tensors]
            with ShardedWriter(tmp, planned, metadata=metadata) as writer:
                for t in extraction.tensors:
                    writer.write(t.name, finite(t.name, t.make().to(t.dtype).contiguous(),
                                                f"from {moe}"))
            (tmp / "config.json").write_text(json.dumps(extraction.config, indent=2) + "\n")
            copy_side_files(moe, tmp, SIDE_FILES)
            (tmp / "README.md").write_text(card(moe, kind, label, extraction))
            if verify and size <= FULL_LOAD_LIMIT:
                check_loads(tmp)
    return Extracted(label, kind, len(extraction.tensors), size)


def choose_extraction(moe: Path, reader: CheckpointReader, config: dict, expert: str | None,
                      weights: str | None) -> tuple[str, Extraction, str]:
    """(kind, extraction, label): expert `expert` of the MoE, or its experts mixed at `weights`,
    by the functions its kind's entry names (recipe/kinds.py)."""
    kind = Kind.of_config(config)
    extract = kind.command("extract" if weights is None else "extract --weights", moe)
    names = expert_labels(moe, kind.shape(config)[0])
    if weights is not None:
        label = f"weights {weights}"
        return kind.name, extract(reader, config, routing_weights(weights, names), label), label
    index = expert_index(expert, names)
    return kind.name, extract(reader, config, index, names[index]), names[index]


def extract_stored_adapter(moe: Path, out: Path, *, expert: str | None, base: str | None,
                           force: bool = False) -> Extracted:
    """Write expert `expert` of an MoE of LoRA experts as the PEFT adapter it stores."""
    from moemerge.built.extract.lora_experts import write_stored_adapter
    from moemerge.io.adapter import LoraAdapter

    moe, out = Path(moe), Path(out)
    config = read_config(moe)
    Kind.of_config(config).require("extract --lora stored", moe)  # (or --lora RANK fits one)
    if expert is None:
        raise RecipeError("--lora stored: give --expert NAME (or an index)")
    names = expert_labels(moe, config["num_experts"])
    index = expert_index(expert, names)
    with atomic_output_dir(out, force=force) as tmp:
        modules = write_stored_adapter(moe, tmp, index, base)
        adapter = LoraAdapter(tmp)  # reads back as moemerge reads adapters
        (tmp / "README.md").write_text(
            f"# {names[index]}, the LoRA adapter of expert {index} of `{moe.name}`\n\n"
            f"Written by `moemerge extract --lora stored` from the MoE of LoRA experts "
            f"`{moe}`: {modules} modules, each at the rank it was stored at, scale 1. Load it "
            f"with peft on the base, `PeftModel.from_pretrained(base_model, path)`"
            + (f" (base: `{adapter.base_model}`)" if adapter.base_model else "") + ".\n")
    size = sum(f.stat().st_size for f in out.iterdir())
    return Extracted(names[index], "lora_experts", 2 * modules, size)


def card(moe: Path, kind: str, label: str, extraction: Extraction) -> str:
    """README.md of the extracted model: where it came from and how it was made."""
    arch = extraction.config["architectures"][0]
    return (f"# {label}, extracted from `{moe.name}`\n\n"
            f"A dense `{arch}` written by `moemerge extract` from the {kind} MoE `{moe}`: "
            f"{extraction.what}.\n\n"
            "It computes what the MoE computes when every token (token_routed, lora_experts), "
            "every sequence (seq_routed) or every segment (merged_experts) is routed to this "
            "expert alone "
            "(docs/extend.md). Load it with `AutoModelForCausalLM.from_pretrained(path)`; it "
            "needs no remote code.\n")
