"""Fused projections seen as their parts (Phi-3): qkv_proj stacks q, k, v and gate_up_proj
stacks gate, up, by rows. A plan that needs a part reads only its rows (Source.rows); a merge
of a fused tensor is made part by part and stacked again (a concat job)."""

from __future__ import annotations

from dataclasses import replace

from moemerge.architectures import TensorRole
from moemerge.plan.jobs import Job
from moemerge.plan.shapes import projection_rows


def fused_parts(role: TensorRole, config: dict) -> dict[str, tuple[int, int]]:
    """{part: (first row, end row)} of a fused tensor ("ffn.gate_up", "attn.qkv" in dense.yaml);
    {} for a tensor that is not fused."""
    rows = projection_rows(config)
    if role.proj == "gate_up":
        inter = config["intermediate_size"]
        return {"gate": (0, inter), "up": (inter, 2 * inter)}
    if role.proj == "qkv":
        q, kv = rows["q"], rows["kv"]
        return {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
    return {}


def split_fused(job: Job, role: TensorRole, config: dict) -> Job:
    """A merge of a whole fused tensor as a concat of the same merge on each part's rows (so
    TIES trims, DARE draws and SLERP angles are per part, as for an unfused family's q, k, v);
    any other job unchanged."""
    parts = fused_parts(role, config)
    if job.kind != "merge" or not parts:
        return job

    def part(name: str, rows: tuple[int, int]) -> Job:
        return replace(job, output=f"{job.output}:{name}",
                       shape=(rows[1] - rows[0], *job.shape[1:]),
                       sources=tuple(replace(s, rows=rows) for s in job.sources),
                       base=replace(job.base, rows=rows) if job.base is not None else None)

    return Job(job.output, job.shape, job.dtype, "concat", job.role, job.layer,
               parts=tuple(part(name, rows) for name, rows in parts.items()))
