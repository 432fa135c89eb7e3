"""The plan: one job per output tensor, known before any tensor data is read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from typing_extensions import assert_never  # typing from 3.11

from moemerge.plan.params import ResolvedMerge

Operation = Literal["copy", "merge", "router", "zeros", "identity", "random", "lstsq", "fuse"]


class Change(Protocol):
    """What a source's tensor becomes before its job uses it, made in the execute loop: an
    upcycled expert's FFN slice (plan/upcycle.py), an expert's embedding rows re-indexed to
    the kept vocabulary (plan/vocab.py). `apply` reads the stored tensor when it needs it (a
    change may hold what it made from it). Hashable: a Source is a key."""

    def apply(self, read: Callable[[], torch.Tensor]) -> torch.Tensor: ...  # read(): stored

    def shape(self, stored: tuple[int, ...]) -> tuple[int, ...]: ...  # what apply returns

    def dtype(self, stored: torch.dtype) -> torch.dtype: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class Source:
    """Tensor `tensor` of input model number `model` (an index into Plan.models); with `rows`
    (first, end), only those rows (a part of a fused tensor, plan/fused.py); with `change`,
    what the job uses is change.apply(those rows)."""

    model: int
    tensor: str
    rows: tuple[int, int] | None = None
    change: Change | None = None


@dataclass(frozen=True)
class Job:
    """How one output tensor is made.

    copy:     sources[0], cast.
    merge:    `merge` over sources, with `base` as reference; sources narrower than the output
              (bridged experts) are zero-padded to its shape first.
    router:   a router weight [E, H]; sources are the experts' gate projections (token routers,
              base = the base's, for the task_vector init) or embeddings (sequence routers).
    zeros:    an all-zero tensor (e.g. Qwen2-MoE's disabled shared expert).
    identity: ones on the main diagonal of the last two axes (a projector that selects or
              zero-pads coordinates; curvature factors that start at the identity).
    random:   N(0, std²), seeded from (recipe seed, output name).
    lstsq:    a bridged projector fitted by least squares: the padded average of `sources`
              (weights) against `base`, the expert's own embedding or head.
    fuse:     `parts` groups of jobs: each group's outputs concatenated by rows, the groups
              stacked ([groups, rows, cols]; [rows, cols] when the shape has two axes):
              the fused experts of GraniteMoE, or one group: a fused tensor (Phi-3's
              qkv_proj) merged part by part as an unfused family's q, k, v (plan/fused.py).
    """

    output: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    operation: Operation
    role: str
    layer: int | None = None
    sources: tuple[Source, ...] = ()
    base: Source | None = None
    weights: tuple[float, ...] = ()
    merge: ResolvedMerge | None = None
    router_init: str | None = None
    std: float | None = None  # kind random
    parts: tuple[tuple[Job, ...], ...] = ()  # kind fuse
    # an embedding or head merged over differing vocabularies: every model's rows (`context`)
    # are aligned to the output's by `vocab` (plan/tokens.py VocabularyAlignment) first, and the
    # job's sources read the aligned rows
    vocab: object | None = None
    context: tuple[Source, ...] = ()
    # the tensor's classic name where the output stores it under another (output.experts:
    # fused renames Mixtral's router): draws are seeded from it and patches address it, so
    # either form holds the same bytes
    classic_name: str | None = None

    @property
    def name(self) -> str:
        """The classic name: what the tensor is called wherever moemerge reads it."""
        return self.classic_name or self.output

    @property
    def inputs(self) -> list[Source]:
        """Every tensor the job reads: its sources, its base, then its context."""
        own = [*self.sources, *([self.base] if self.base is not None else []), *self.context]
        return own + [s for group in self.parts for part in group for s in part.inputs]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass
class Plan:
    """Everything `execute` needs: labelled inputs, the jobs in write order, the output config."""

    labels: list[str]
    jobs: list[Job]
    config: dict
    notes: list[str] = field(default_factory=list)  # build warns each; the model card lists them
    # what the build decides on the written model (calibration's choices), for --dry-run
    decided_later: list[str] = field(default_factory=list)
    tokenizer: str | None = None  # the output's tokenizer.json when the plan makes one
    resident_bytes: int = 0  # what the sources' changes hold between jobs (the memory estimate)
    # (input, tensor) -> what the input's reader makes of its stored tensor ("base + LoRA
    # r=8": a LoRA adapter on the model, io/adapter.py), for --dry-run
    made: dict[tuple[int, str], str] = field(default_factory=dict)
    making_bytes: int = 0  # the most that making one such tensor holds beyond it (the reader)

    @property
    def total_bytes(self) -> int:
        return sum(job.nbytes for job in self.jobs)

    def describe_job(self, job: Job) -> str:
        def made(s: Source) -> str:
            return f" = {self.made[s.model, s.tensor]}" if (s.model, s.tensor) in self.made else ""

        def src(s: Source) -> str:
            change = f" as {s.change.describe()}" if s.change is not None else ""
            return f"{self.labels[s.model]}:{s.tensor}{made(s)}{change}"

        match job.operation:  # every Operation (assert_never: a new one must say what it does)
            case "copy":
                how = f"copy {src(job.sources[0])}"
            case "merge":
                assert job.merge is not None
                base = f" base={self.labels[job.base.model]}{made(job.base)}" if job.base else ""
                models = ", ".join(self.labels[s.model] + made(s) + (
                    f" ({s.change.describe()})" if s.change else "") for s in job.sources)
                how = f"{job.merge.describe()} of [{models}]{base}"
            case "router":
                how = f"router init={job.router_init}"
            case "random":
                how = f"random std={job.std:g}"
            case "fuse" if len(job.parts) == 1:  # a fused tensor's parts
                how = "; ".join(f"{p.output.rsplit(':', 1)[-1]}: {self.describe_job(p)}"
                                for p in job.parts[0])
            case "fuse":
                how = (f"fuse {len(job.parts)} × [" + "; ".join(self.describe_job(p) for p in
                                                              job.parts[0]) + ", …]")
            case "zeros" | "identity" | "lstsq":
                how = job.operation
            case unknown:
                assert_never(unknown)
        if job.router_init == "calibrate":
            how += " (a placeholder here: fitted on the written model)"
        if job.vocab is not None:
            how += f"; {job.vocab.describe()}"
        return how
