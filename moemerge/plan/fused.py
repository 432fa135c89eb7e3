"""On-disk tensors that hold several planned ones, for layouts whose experts are fused
(GraniteMoE: input_linear [E, 2I, H], each expert's gate rows then its up rows; output_linear
[E, H, I]; its shared MLP the same without the expert axis).

The plans make every layout's experts as per-expert, per-projection jobs named by the layout's
`expert` / `shared_expert` patterns; `fuse_jobs` then replaces each group of them by one `fuse`
job, at the position of the group's first member, as moe.yaml's `fused` / `fused_shared` say.
"""

from __future__ import annotations

from itertools import count

from moemerge.architectures.tables import MoELayout
from moemerge.errors import MismatchError
from moemerge.plan.jobs import Job


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
    return [fused.get(job.output, job) for job in jobs
            if job.output in fused or job.output not in members]
