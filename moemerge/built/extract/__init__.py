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
from moemerge.architectures.forms import layout_of
from moemerge.built.extract.choice import expert_index, one_hot, routing_weights
from moemerge.errors import CheckpointError, RecipeError
from moemerge.finish.verify import FULL_LOAD_LIMIT, check_loads
from moemerge.io.atomic import SIDE_FILES, atomic_output_dir, copy_side_files
from moemerge.io.reader import CheckpointReader, read_config
from moemerge.io.tensor_list import Extraction, write_order
from moemerge.io.writer import ShardedWriter, finite
from moemerge.modeling import is_lora_experts, is_merged_experts, is_sequence_routed

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
    """(kind, extraction, label) for the MoE's kind."""
    from moemerge.built.extract.merged import extract_merged
    from moemerge.built.extract.seq_routed import extract_seq_routed
    from moemerge.io.moe_expert import extract_token_routed

    layout = layout_of(config)
    if layout is not None:
        count = layout.expert_count(config)
    elif is_sequence_routed(config) or is_merged_experts(config) or is_lora_experts(config):
        count = len(config["experts"]) if is_sequence_routed(config) else config["num_experts"]
    else:
        raise CheckpointError(f"{moe}: model_type {config.get('model_type')!r} is not an MoE "
                              "moemerge builds (token_routed, seq_routed, merged_experts, "
                              "lora_experts)")
    names = expert_labels(moe, count)
    if weights is not None and not is_merged_experts(config):
        raise RecipeError("--weights: only a merged_experts MoE merges its experts' weights; "
                          "give --expert NAME for this one")
    if is_merged_experts(config):
        scores = routing_weights(weights, names) if weights is not None else \
            one_hot(index := expert_index(expert, names), count)
        label = names[index] if weights is None else f"weights {weights}"
        return "merged_experts", extract_merged(reader, config, scores, label), label
    index = expert_index(expert, names)
    if is_lora_experts(config):
        from moemerge.built.extract.lora_experts import extract_lora_expert

        return "lora_experts", extract_lora_expert(reader, config, index,
                                                   names[index]), names[index]
    if layout is not None:
        return "token_routed", extract_token_routed(reader, config, layout, index,
                                                    names[index]), names[index]
    return "seq_routed", extract_seq_routed(reader, config, index, names[index]), names[index]


def extract_stored_adapter(moe: Path, out: Path, *, expert: str | None, base: str | None,
                           force: bool = False) -> Extracted:
    """Write expert `expert` of an MoE of LoRA experts as the PEFT adapter it stores."""
    from moemerge.built.extract.lora_experts import write_stored_adapter
    from moemerge.io.adapter import LoraAdapter

    moe, out = Path(moe), Path(out)
    config = read_config(moe)
    if not is_lora_experts(config):
        raise RecipeError(f"--lora stored: {moe} is not an MoE of LoRA experts (model_type "
                          f"{config.get('model_type')!r}); give --lora RANK|auto --base BASE "
                          "to fit an adapter to one of its experts")
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
