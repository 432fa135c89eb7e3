"""Tensors that hold several planned ones: fused on disk.

- Output layouts whose experts are fused (GraniteMoE: input_linear [E, 2I, H], each expert's
  gate rows then its up rows; output_linear [E, H, I]; its shared MLP the same without the
  expert axis). The plans make every layout's experts as per-expert, per-projection jobs named
  by the layout's `expert` / `shared_expert` patterns; `fuse_jobs` then replaces each group of
  them by one `fuse` job, at the position of the group's first member, as moe.yaml's `fused` /
  `fused_shared` say.
- Source families with fused projections (Phi-3): qkv_proj stacks q, k, v and gate_up_proj
  stacks gate, up, by rows. A plan that needs a part reads only its rows (Source.rows); a merge
  of a fused tensor is made part by part and stacked again (`split_fused`: a `fuse` job of one
  group).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import count

from moemerge.architectures import TensorRole
from moemerge.architectures.forms import FUSED, renamed_name
from moemerge.architectures.tables import MoELayout
from moemerge.errors import MismatchError
from moemerge.plan.jobs import Job
from moemerge.plan.shapes import projection_rows


def fuse_jobs(layout: MoELayout, jobs: list[Job]) -> list[Job]:
    if not layout.fused and not layout.fused_shared:
        return jobs
    by_name = {job.output: job for job in jobs}
    fused: dict[str, Job] = {}  # first member's output -> the fused job that replaces it
    members: set[str] = set()

    def add(output: str, groups: list[tuple[Job, ...]], stacked: bool) -> None:
        first = groups[0]
        rows, cols = sum(p.shape[0] for p in first), first[0].shape[1]
        if any(p.shape[1] != cols for g in groups for p in g) or any(
                sum(p.shape[0] for p in g) != rows for g in groups):
            raise MismatchError(f"{output}: the tensors fused into it differ in shape "
                                f"({[p.shape for p in first]})")
        shape = (len(groups), rows, cols) if stacked else (rows, cols)
        fused[first[0].output] = Job(output, shape, first[0].dtype, "fuse", first[0].role,
                                     first[0].layer, parts=tuple(groups))
        members.update(p.output for g in groups for p in g)

    for layer in sorted({job.layer for job in jobs if job.layer is not None}):
        for pattern, projs in layout.fused.items():
            groups = []
            for expert in count():
                names = [layout.expert_name(layer, expert, proj) for proj in projs]
                if names[0] not in by_name:
                    break
                groups.append(tuple(by_name[n] for n in names))
            if groups:
                add(pattern.format(layer=layer), groups, stacked=True)
        for pattern, projs in layout.fused_shared.items():
            names = [layout.shared_name(layer, proj) for proj in projs]
            if names[0] in by_name:
                add(pattern.format(layer=layer), [tuple(by_name[n] for n in names)],
                    stacked=False)
    jobs = [fused.get(job.output, job) for job in jobs
            if job.output in fused or job.output not in members]
    if layout.form == FUSED:  # the fused form's own names, the draws still the classic ones
        jobs = [replace(job, output=stored, classic_name=job.output)
                if (stored := renamed_name(layout, job.output)) != job.output else job
                for job in jobs]
    return jobs


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
    """A merge of a whole fused tensor as the rows of the same merge on each part's rows (so
    TIES trims, DARE draws and SLERP angles are per part, as for an unfused family's q, k, v);
    any other job unchanged."""
    parts = fused_parts(role, config)
    if job.operation != "merge" or not parts:
        return job

    def part(name: str, rows: tuple[int, int]) -> Job:
        return replace(job, output=f"{job.output}:{name}",
                       shape=(rows[1] - rows[0], *job.shape[1:]),
                       sources=tuple(replace(s, rows=rows) for s in job.sources),
                       base=replace(job.base, rows=rows) if job.base is not None else None)

    return Job(job.output, job.shape, job.dtype, "fuse", job.role, job.layer,
               parts=(tuple(part(name, rows) for name, rows in parts.items()),))
