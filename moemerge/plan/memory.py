"""What a build will hold in memory and write, estimated from the plan before any data is read.

The executor keeps at most `lookahead` jobs in flight, each holding its inputs as read and its
output (benchmarks/README.md, "Peak memory of a build"); a merge's own float32 working set is a
few row blocks for the methods that run in blocks (merge/blocks.py) and several float32 copies
of the whole tensor per model for the others.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from moemerge.merge.blocks import BLOCK_ELEMENTS
from moemerge.merge.registry import get
from moemerge.plan.jobs import Job, Plan, Source
from moemerge.plan.sources import SourceModel

# float32 bytes per entry per model of a merge's working set (tests/integration/
# test_memory_bound.py measures them): a block's for blocked methods, the tensor's otherwise
BLOCK_WORKING = 4 * 6
WHOLE_WORKING = (8, 20)  # a + b · (models − 1)


@dataclass(frozen=True)
class Estimate:
    peak_bytes: int  # above the process's memory before the build
    output_bytes: int


def working_set(job: Job) -> int:
    """The merge's own float32 working set beyond its inputs and output."""
    if job.operation == "fuse":  # its parts are computed one after another
        return max(working_set(part) for group in job.parts for part in group)
    if job.operation != "merge" or job.merge is None:
        return 0
    n = len(job.inputs)
    numel = job.nbytes // job.dtype.itemsize
    if get(job.merge.method).runs_in_blocks(job.merge.params):
        return min(numel, BLOCK_ELEMENTS) * BLOCK_WORKING * n
    a, b = WHOLE_WORKING
    return numel * (a + b * max(0, n - 1))


def source_bytes(models: list[SourceModel]) -> Callable[[Source], int]:
    """The bytes a source holds once read: its stored tensor's, or what its change makes."""
    def size(source: Source) -> int:
        meta = models[source.model].reader.meta(source.tensor)
        if source.change is None:
            return meta.nbytes
        shape = source.change.shape(tuple(meta.shape))
        return math.prod(shape) * source.change.dtype(meta.dtype).itemsize

    return size


def window_bytes(plan: Plan, source_bytes: Callable[[Source], int], lookahead: int = 3) -> int:
    """The most that any `lookahead` consecutive jobs hold: their inputs and outputs (also
    the executor's buffer pool's capacity, moemerge/buffers.py)."""
    held = [sum(map(source_bytes, job.inputs)) + job.nbytes for job in plan.jobs]
    return max((sum(held[i:i + lookahead]) for i in range(len(held))), default=0)


def estimate(plan: Plan, source_bytes: Callable[[Source], int], lookahead: int = 3) -> Estimate:
    """The peak over every `lookahead` consecutive jobs of their inputs and outputs (a pool of
    reused buffers holds no more, buffers.py), plus the output being written, the largest
    working set of one merge, what the sources' changes hold between jobs
    (Plan.resident_bytes: upcycling's float32 copy of a dense FFN tensor) and what the read
    thread holds while it makes one tensor (Plan.making_bytes: a LoRA's float32 delta)."""
    writing = max((job.nbytes for job in plan.jobs), default=0)
    return Estimate(window_bytes(plan, source_bytes, lookahead) + writing
                    + max(map(working_set, plan.jobs), default=0) + plan.resident_bytes
                    + plan.making_bytes, plan.total_bytes)
