"""Reused memory for the large tensors a build reads and writes.

A fresh tensor's pages are faulted in and zeroed by the kernel on first touch: a TIES build of
four Llama-3.2-1B-shaped experts spent 31 % of its CPU time zeroing pages (perf:
clear_page_erms under the reads' copy_to_iter and the merge's first writes), for memory that
was freed a moment later. A `BufferPool` keeps the buffers and hands out views of them; a
buffer is free again once no view of it is left (its storage's use count is back to the
pool's own), so whoever holds a tensor (a merge, a router factory's cache, the writer) keeps
it as long as it likes and releases nothing by hand.

The pool holds at most `capacity` bytes, free buffers included (the executor passes the
plan's in-flight window, plan/memory.window_bytes, so the build's memory estimate stays an
upper bound): a request that would pass it first lets go of free buffers, least recently
used first, and is a plain `torch.empty` when that is not enough. Buffers are reused for
requests of the same size, rounded up to 2 MiB (a layer's tensors come back in the same
shapes layer after layer). Tensors under 1 MiB come from torch's allocator (the C heap
reuses those already).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

SMALLEST = 1 << 20  # bytes: smaller tensors are plain torch.empty
GRAIN = 2 << 20  # sizes rounded up to whole huge pages


def _use_count(buffer: Tensor) -> int:
    return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata)


class BufferPool:
    def __init__(self, capacity: int):
        self.capacity = capacity
        # (uint8 buffer, its use count when idle), least recently used first
        self._buffers: list[tuple[Tensor, int]] = []
        self._lock = threading.Lock()
        self.reused = self.made = 0  # requests served by a kept buffer / by a new one

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        """An uninitialised CPU tensor, in a kept buffer where one fits."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < SMALLEST:
            return torch.empty(tuple(shape), dtype=dtype)
        with self._lock:
            buffer = self._take(-(-nbytes // GRAIN) * GRAIN)
        if buffer is None:
            return torch.empty(tuple(shape), dtype=dtype)
        return buffer[:nbytes].view(dtype).view(tuple(shape))

    def _take(self, size: int) -> Tensor | None:
        free = [i for i, (b, idle) in enumerate(self._buffers) if _use_count(b) == idle]
        for i in free:
            if self._buffers[i][0].numel() == size:
                entry = self._buffers.pop(i)
                self._buffers.append(entry)  # most recently used last
                self.reused += 1
                return entry[0]
        held = sum(b.numel() for b, _ in self._buffers)
        drop = []
        for i in free:  # least recently used first
            if held + size <= self.capacity:
                break
            drop.append(i)
            held -= self._buffers[i][0].numel()
        for i in reversed(drop):  # from the end, so the indices stay valid
            del self._buffers[i]
        if held + size > self.capacity:
            return None
        buffer = torch.empty(size, dtype=torch.uint8)
        self._buffers.append((buffer, _use_count(buffer)))
        self.made += 1
        return buffer

    def held_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b, _ in self._buffers)


_active: BufferPool | None = None


@contextmanager
def pooled(capacity: int) -> Iterator[BufferPool]:
    """Serve `empty` from a pool of `capacity` bytes while the block runs (one build)."""
    global _active
    previous, _active = _active, BufferPool(capacity)
    try:
        yield _active
    finally:
        _active = previous


def empty(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """torch.empty on the CPU, from the active pool when a build runs one."""
    pool = _active
    return pool.empty(shape, dtype) if pool is not None else torch.empty(tuple(shape), dtype=dtype)
