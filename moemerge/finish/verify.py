"""Check a freshly written checkpoint before the build says it is done."""

from __future__ import annotations

from pathlib import Path

import torch

from moemerge.errors import OutputError
from moemerge.io.reader import CheckpointReader
from moemerge.loading import load_pretrained
from moemerge.plan.jobs import Plan

FULL_LOAD_LIMIT = 2 * 2**30  # bytes; above this only the structure is checked by default


def check_structure(directory: Path, plan: Plan) -> None:
    """Every planned tensor is on disk with its shape and dtype, and nothing else is."""
    with CheckpointReader(directory) as reader:
        written = reader.metas
        planned = {job.output: job for job in plan.jobs}
        missing = sorted(set(planned) - set(written))
        extra = sorted(set(written) - set(planned))
        if missing or extra:
            raise OutputError(
                f"output check failed in {directory}: missing {missing[:3]}, unexpected {extra[:3]}"
            )
        for name, meta in written.items():
            job = planned[name]
            if meta.shape != tuple(job.shape) or meta.dtype != job.dtype:
                raise OutputError(
                    f"output check failed: {name} is {meta.dtype} {list(meta.shape)} on disk, "
                    f"planned {job.dtype} {list(job.shape)}"
                )


def check_loads(directory: Path) -> None:
    """Load with transformers and insist on no missing, unexpected or misshapen tensors
    (moemerge's own kinds with the installed code, of which the shipped files are copies:
    nothing is imported from the output directory)."""
    try:
        _, info = load_pretrained("AutoModelForCausalLM", directory, output_loading_info=True,
                                  dtype=torch.float32)
    except Exception as exc:  # any failure here means the output is not usable
        raise OutputError(f"output check failed: transformers cannot load it: {exc}") from exc
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"} | (
        {"errors": info["error_msgs"]} if info.get("error_msgs") else {}
    )
    if problems:
        raise OutputError(f"output check failed: transformers reports {problems}")
