"""A sequence-routed MoE's expert: its whole decoder stack, as the dense model it came from.

The expert's `experts.{e}.model.*` tensors become `model.*`; the embedding and head are the
expert's own copies (per_expert) or the shared merged ones the MoE routed it with. A
sequence routed to this one expert alone (k = 1) gets exactly these logits; with per_expert
embedding and head they are the source expert's own.
"""

from __future__ import annotations

from moemerge.architectures.config import dense_config
from moemerge.errors import CheckpointError
from moemerge.io.reader import CheckpointReader
from moemerge.io.tensor_list import Extraction, config_dtype, resolve_tie

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
SHARED = {"embed_tokens.weight": EMBED, "lm_head.weight": HEAD}


def extract_seq_routed(reader: CheckpointReader, config: dict, expert: int,
                       label: str) -> Extraction:
    source = config["experts"][expert]
    extraction = Extraction(dense_config(source, config_dtype(source)))
    own = f"experts.{expert}."
    for name in reader.names():
        if name.startswith(own):
            extraction.copy(reader, name, name.removeprefix(own))
        elif name in SHARED:  # shared only where the expert has no copy of its own
            extraction.copy(reader, name, SHARED[name])
    present = extraction.names
    if not present >= {EMBED, HEAD}:
        raise CheckpointError(f"expert {expert}: no embedding or head found "
                              f"({sorted({EMBED, HEAD} - present)} missing)")
    resolve_tie(extraction, reader, EMBED, HEAD)
    shared = [k for k, flag in (("embedding", "shared_embeddings"), ("head", "shared_lm_head"))
              if config.get(flag, True)]
    extraction.what = (f"expert {expert} ({label!r}) of a sequence-routed MoE: its whole "
                       "decoder stack, with " + (f"the MoE's shared {' and '.join(shared)}"
                                                 if shared else "its own embedding and head"))
    return extraction

