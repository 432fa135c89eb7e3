"""Check a freshly written checkpoint before the build says it is done."""

from __future__ import annotations

from pathlib import Path

import torch

from moemerge.errors import OutputError
from moemerge.io.reader import CheckpointReader
from moemerge.loading import load_pretrained
from moemerge.plan.jobs import Plan

FULL_LOAD_LIMIT = 2 * 2**30  # bytes; above this only the structure is checked by default
PROBE_TOKENS = 4  # the forward pass of the load check: ids 0..3


def check_structure(directory: Path, plan: Plan) -> None:
    """Every planned tensor is on disk with its shape and dtype, and nothing else is."""
    with CheckpointReader(directory) as reader:
        written = reader.on_disk  # (the names the plan wrote: a fused output's stacks)
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


def check_loads(directory: Path, finite: bool = True) -> str:
    """Load with transformers, insist on no missing, unexpected or misshapen tensors, and run
    a few tokens through it, their logits finite unless `finite` is False (build
    --allow-non-finite wrote NaN/Inf on purpose). moemerge's own kinds load with the installed
    code, of which the shipped files are copies: nothing is imported from the output
    directory. Returns what was checked, for the build's progress line ("loaded in
    transformers as MixtralForCausalLM, logits finite"): a tiny model loads in a blink, and a
    bare time would not say that anything ran."""
    try:
        model, info = load_pretrained("AutoModelForCausalLM", directory,
                                      output_loading_info=True, dtype=torch.float32)
    except Exception as exc:  # any failure here means the output is not usable
        raise OutputError(f"output check failed: transformers cannot load it: {exc}") from exc
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"} | (
        {"errors": info["error_msgs"]} if info.get("error_msgs") else {}
    )
    if problems:
        raise OutputError(f"output check failed: transformers reports {problems}")
    name = type(model).__name__
    try:
        with torch.no_grad():  # ids every vocabulary has
            logits = model.eval()(input_ids=torch.arange(PROBE_TOKENS)[None]).logits
    except Exception as exc:
        raise OutputError(f"output check failed: {name} loads from {directory} but a forward "
                          f"pass of {PROBE_TOKENS} tokens fails: {exc}") from exc
    if not finite:
        return f"loaded in transformers as {name}, {PROBE_TOKENS} tokens run"
    if not bool(torch.isfinite(logits).all()):
        raise OutputError(f"output check failed: {name} from {directory} computes NaN/Inf "
                          f"logits for {PROBE_TOKENS} tokens")
    return f"loaded in transformers as {name}, logits finite"
