"""The one loop that moves tensor data: read sources, merge, cast, write.

A three-stage pipeline: one thread reads the sources of upcoming jobs, `workers` threads merge,
the caller's thread writes. Torch kernels and file IO release the GIL, so the stages overlap;
at most `lookahead` jobs are in flight, which bounds memory to a few tensors per input model.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch
from typing_extensions import assert_never  # typing from 3.11

from moemerge import buffers
from moemerge.errors import CheckpointError, RecipeError
from moemerge.io.reader import TensorMeta, count_non_finite_stored
from moemerge.io.writer import ShardedWriter, finite, refuse_non_finite
from moemerge.merge.dispatch import merge
from moemerge.merge.draws import Draws
from moemerge.merge.least_squares import padded_average_fit
from moemerge.merge.primitives import count_non_finite, generator_for, zero_pad
from moemerge.plan.jobs import Job, Plan, Source
from moemerge.plan.sources import SourceModel

Load = Callable[[Source], torch.Tensor]
Read = Callable[[int, str], torch.Tensor]  # (model index, tensor name) -> the stored tensor
# where a source's bytes lie when they are the output unchanged (no cast, no slice), else None
Stored = Callable[[Source], TensorMeta | None]
MakeRouter = Callable[[Job, Load], torch.Tensor]


def check_device(name: str) -> torch.device:
    """The device a build merges on: "cpu", "cuda[:N]" when one is there, or "meta" (shapes
    and dtypes only, for tests of the device plumbing)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise RecipeError(f"--device: not a device name: {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RecipeError("--device cuda: torch sees no CUDA device here (torch "
                          f"{torch.__version__}); use --device cpu")
    if device.type not in ("cpu", "cuda", "meta"):
        raise RecipeError(f"--device: cpu or cuda, got {name!r}")
    return device


def _fused(job: Job, make: Callable[[Job], torch.Tensor]) -> torch.Tensor:
    """A fuse job's tensor, each part written into its rows as it is made: the stack and one
    part in memory, not every part and two copies of them."""
    rows, cols = job.shape[-2:]
    out = None
    for g, group in enumerate(job.parts):
        at = 0
        for part in group:
            piece = make(part)
            if out is None:
                out = torch.empty((len(job.parts), rows, cols), dtype=piece.dtype,
                                  device=piece.device)
            out[g, at:at + piece.shape[0]] = piece.reshape(-1, cols)
            at += piece.shape[0]
            del piece
    assert out is not None, f"{job.output}: a fuse job with no parts"
    return out.reshape(job.shape)


def compute(job: Job, load: Load, make_router: MakeRouter | None, seed: int,
            device: torch.device | str = "cpu") -> torch.Tensor:
    """The output tensor of one job, in the job's dtype, on the CPU. A merge's arithmetic runs
    on `device` (its inputs are moved there and the result back); reading, routers, random
    draws and writing stay on the host."""
    if job.vocab is not None:  # every model's rows re-indexed to the output vocabulary first
        aligned = job.vocab.align({s.model: load(s) for s in job.context})

        def load(source: Source) -> torch.Tensor:
            return aligned[source.model]

    match job.operation:  # every Operation, or the type checker and assert_never say which not
        case "copy":
            out = load(job.sources[0])
        case "zeros":
            out = torch.zeros(job.shape)
        case "identity":  # [..., r, c]: an identity matrix in every leading slot
            out = torch.eye(*job.shape[-2:]).expand(job.shape)
        case "lstsq":
            out = projector_fit(job, load)
        case "random":
            out = torch.randn(job.shape, generator=generator_for(seed, job.name)) * job.std
        case "router":
            assert make_router is not None, "router job without a router factory"
            out = make_router(job, load)
        case "fuse":  # each group's parts by rows, the groups stacked [G, rows, cols]
            out = _fused(job, lambda part: compute(part, load, make_router, seed, device))
        case "merge":
            out = _merged(job, load, seed, device)
        case unknown:
            assert_never(unknown)
    return out.to(device="cpu", dtype=job.dtype).contiguous()


def _merged(job: Job, load: Load, seed: int, device: torch.device | str) -> torch.Tensor:
    """A merge job's tensor: its method over its sources (each moved to `device`)."""
    params = job.merge
    assert params is not None

    def on_device(source: Source) -> torch.Tensor:
        return load(source).to(device, non_blocking=True)

    return merge(
        params.method,
        base=on_device(job.base) if job.base is not None else None,
        tensors=[zero_pad(on_device(s), job.shape) for s in job.sources],
        weights=list(job.weights) or None,
        # counter-based draws per output tensor: the same bytes in any order, on any device
        draws=Draws.of(seed, job.name),
        dtype=job.dtype,  # large tensors are merged in row blocks straight into it
        **params.params,
    )


def projector_fit(job: Job, load: Load) -> torch.Tensor:
    """The least-squares linear map of a bridged projector. shared [V, d_m] = the padded
    average of the sources (the shared embedding or head, as built), own [V, d_i] = the
    expert's. proj_in: shared @ Lᵀ ≈ own, L [d_i, d_m]; proj_out: shared @ L ≈ own, L [d_m, d_i]
    (the shared head on L h gives the expert's own logits). Solved from row blocks."""
    width = job.shape[1] if job.role == "proj_in" else job.shape[0]
    solution = padded_average_fit([load(s) for s in job.sources], job.weights, load(job.base),
                                  width)  # [d_m, d_i]
    return solution.T if job.role == "proj_in" else solution


def _serialised(function: MakeRouter) -> MakeRouter:
    lock = threading.Lock()

    def call(job: Job, load: Load) -> torch.Tensor:
        with lock:
            return function(job, load)

    return call


def take(source: Source, read: Read) -> torch.Tensor:
    """A source as its job uses it: the stored tensor, its rows, then its change."""
    def stored() -> torch.Tensor:
        tensor = read(source.model, source.tensor)
        return tensor if source.rows is None else tensor[slice(*source.rows)]

    return stored() if source.change is None else source.change.apply(stored)


def byte_copy(job: Job, stored: Stored | None) -> TensorMeta | None:
    """The stored tensor a copy job passes through unchanged, if its bytes are the output's."""
    if job.operation != "copy" or stored is None or job.vocab is not None:
        return None
    source = job.sources[0]
    if source.rows is not None or source.change is not None:
        return None
    meta = stored(source)
    same = meta is not None and meta.dtype == job.dtype and meta.shape == tuple(job.shape)
    return meta if same else None


class CheckedTensors:
    """The build's tensors in and out of the loop. NaN / Inf in an input tensor is a warning
    naming the tensor and the model (once per tensor), an error with `strict`; a non-finite
    output tensor is refused unless `allow_non_finite`."""

    WHENCE = ("from non-finite inputs or merge settings; pass --allow-non-finite to write it "
              "anyway")

    def __init__(self, models: list[SourceModel], *, strict: bool, allow_non_finite: bool,
                 warn: Callable[[str], None]):
        self.models, self.strict, self.allow_non_finite = models, strict, allow_non_finite
        self.warn = warn
        self._checked: set[tuple[int, str]] = set()
        self._warned: set[tuple[int, str]] = set()

    def read(self, model: int, tensor: str) -> torch.Tensor:
        stored = self.models[model].reader.read(tensor)
        if (model, tensor) not in self._checked:
            self._input_count(model, tensor, count_non_finite(stored))
        return stored

    def load(self, source: Source) -> torch.Tensor:
        if source.change is None:
            return take(source, self.read)
        # a change reads its stored tensor when it needs it (upcycling: once for N·m slices);
        # what it makes (float32, a slice) is checked instead, for the tensor it came from: a
        # check of the stored bf16 tensor in the reader thread cost up to 120 MiB of peak RSS
        # (tests/integration/test_memory_bound.py)
        made = take(source, lambda model, name: self.models[model].reader.read(name))
        self._input_count(source.model, source.tensor, count_non_finite(made),
                          f" as {source.change.describe()}")
        return made

    def stored(self, source: Source) -> TensorMeta | None:
        return self.models[source.model].reader.stored(source.tensor)

    def check_output(self, name: str, tensor: torch.Tensor) -> None:
        if not self.allow_non_finite:
            finite(name, tensor, self.WHENCE)

    def put(self, writer: ShardedWriter, job: Job, tensor: torch.Tensor | TensorMeta) -> None:
        if isinstance(tensor, torch.Tensor):
            self.check_output(job.output, tensor)
            writer.write(job.output, tensor)
            return
        # copied unchanged by the kernel: its values checked in place, once, as both the input
        # it is and the output it becomes
        bad = count_non_finite_stored(tensor)
        source = job.sources[0]
        self._input_count(source.model, source.tensor, bad)
        if not self.allow_non_finite:
            refuse_non_finite(job.output, bad, self.WHENCE)
        writer.copy(job.output, tensor)

    def _input_count(self, model: int, tensor: str, bad: int, made: str = "") -> None:
        self._checked.add((model, tensor))
        if bad and (model, tensor) not in self._warned:
            self._warned.add((model, tensor))
            message = (f"tensor {tensor!r} of {self.models[model].where()}{made} holds {bad} "
                       "NaN/Inf values")
            if self.strict:
                raise CheckpointError(f"{message} (--strict)")
            self.warn(message)


def intra_op_threads(workers: int) -> int:
    """Torch threads per merge worker: the cores this process may use, less one for the reader
    and the writer, shared by the workers. Each pool sized alone (torch's default: every core)
    makes them fight: on 2 cores a 1B-shape average build switched context 97k times with 2
    torch threads and 2.5k with 1 (benchmarks/results/scale.md)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, ((cores or 1) - 1) // max(1, workers))


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def run_jobs(
    plan: Plan, load: Load, make_router: MakeRouter | None, seed: int, *, lookahead: int = 3,
    workers: int = 1, device: torch.device | str = "cpu", stored: Stored | None = None,
    pool_bytes: int = 0,
) -> Iterator[tuple[Job, torch.Tensor | TensorMeta]]:
    """Yield (job, tensor) in plan order, computing up to `lookahead` jobs ahead on `workers`
    merge threads (each output tensor's bytes depend only on its own job: random methods draw
    from a hash of (seed, tensor name, entry), so any worker count gives the same output).
    With `stored`, a copy whose bytes are the output's is yielded as (job, TensorMeta), unread,
    for the writer to copy file to file. Tensors read and merged come from a pool of
    `pool_bytes` of reused buffers (buffers.py; 0: none)."""
    lookahead = max(lookahead, workers)
    if make_router is not None and workers > 1:  # router factories cache what they read
        make_router = _serialised(make_router)

    def prefetch(job: Job) -> dict[Source, torch.Tensor]:
        return {s: load(s) for s in job.inputs}

    with (
        buffers.pooled(pool_bytes),
        torch_threads(intra_op_threads(workers)),
        ThreadPoolExecutor(1, "moemerge-read") as reads,
        ThreadPoolExecutor(workers, "moemerge-merge") as merges,
    ):
        pending: deque[tuple[Job, Future]] = deque()
        jobs = iter(plan.jobs)

        def submit(job: Job) -> None:
            if (meta := byte_copy(job, stored)) is not None:
                done: Future = Future()
                done.set_result(meta)
                pending.append((job, done))
                return
            loaded = reads.submit(prefetch, job)
            pending.append((job, merges.submit(
                lambda: compute(job, loaded.result().__getitem__, make_router, seed, device)
            )))

        for job in jobs:
            submit(job)
            if len(pending) >= lookahead:
                break
        while pending:
            job, future = pending.popleft()
            yield job, future.result()
            next_job = next(jobs, None)
            if next_job is not None:
                submit(next_job)
