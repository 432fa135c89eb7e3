"""`moemerge export`: fold a merged-experts model's curvature into its experts.

E'_i = E_m + M_i τ_i for every layer and projection (E_m the layer's reference, the carried one
in a dynamic model), then the curvature tensors are dropped and config.json says curvature
"none": the exported model computes the same outputs (TIES-CA masks are elected from M_i τ_i,
which is exactly the exported τ'_i) and needs no curvature at inference.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moemerge.errors import CheckpointError
from moemerge.finish.remote_code import copy_modeling_code
from moemerge.io.atomic import RECIPE_COPY, SIDE_FILES, atomic_output_dir, copy_side_files
from moemerge.io.reader import CheckpointReader, read_config
from moemerge.io.writer import ShardedWriter, finite
from moemerge.loading import load_pretrained
from moemerge.recipe.kinds import Kind

CURVATURE = ".mlp.curvature."
KEEP = (*SIDE_FILES, RECIPE_COPY)


def bake_curvature(model_dir: Path, out: Path, *, force: bool = False,
                   max_shard_bytes: int = 5 * 10**9) -> list[str]:
    """Write the baked model to `out` (atomically); return the names of the baked tensors."""
    model_dir, out = Path(model_dir), Path(out)
    config = read_config(model_dir)
    Kind.of_config(config).require("bake", model_dir)  # only merged experts have curvature
    if config.get("curvature") == "none":
        raise CheckpointError(f"{model_dir}: has no curvature (curvature: none); nothing to bake")
    with CheckpointReader(model_dir) as reader:
        try:  # the installed modeling code, never the model dir's
            model = load_pretrained("AutoModelForCausalLM", model_dir, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot load {model_dir}: {exc}") from None
        baked = model.baked_experts()
        names = [n for n in reader.names() if CURVATURE not in n]
        planned = [(n, reader.meta(n).dtype, reader.meta(n).shape) for n in names]
        size = sum(reader.meta(n).nbytes for n in names)
        with atomic_output_dir(out, force=force, size=size) as tmp:
            with ShardedWriter(tmp, planned, max_shard_bytes=max_shard_bytes) as writer:
                for name, dtype, _ in planned:
                    tensor = baked[name] if name in baked else reader.read(name)
                    writer.write(name, finite(name, tensor.to(dtype).contiguous(),
                                              f"{model_dir} with its curvature folded in"))
            (tmp / "config.json").write_text(json.dumps({**config, "curvature": "none"},
                                                        indent=2) + "\n")
            copy_side_files(model_dir, tmp, KEEP)
            copy_modeling_code(tmp)
    return sorted(baked)

