"""A streaming sharded safetensors writer: headers first, then tensors in any order.

Every shard's header is computed from the planned (name, dtype, shape) list before any data
exists, each file is created at its full size, and `write` puts a tensor's bytes at its offset:
peak memory is one tensor, and each file is byte-identical to `safetensors.torch.save_file` of
the same tensors (with metadata {"format": "pt"}; safetensors orders further metadata keys by
hash, so with more keys only the order inside `__metadata__` may differ).

`copy` puts a stored tensor's bytes in by the kernel (`os.copy_file_range`: page cache to page
cache, nothing through this process), falling back to a buffered copy where the file systems
refuse it.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import struct
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from functools import cache
from pathlib import Path

import torch

from moemerge.architectures.forms import classic_view
from moemerge.errors import CheckpointError, OutputError
from moemerge.io.atomic import NO_SPACE, NoSpaceLeft
from moemerge.io.reader import (
    DTYPES,
    SAFETENSORS_INDEX,
    TensorMeta,
    read_config,
    read_safetensors_header,
)
from moemerge.merge.primitives import count_non_finite
from moemerge.words import plural

Planned = tuple[str, torch.dtype, tuple[int, ...]]
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# decimal units (KB, MB, GB and bare K, M, G, as mergekit and `hf` print sizes), binary KiB…
_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9,
          "GB": 10**9, "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes from a size: 123 or "123" -> 123, "5GB"/"5G" -> 5·10⁹, "2GiB" -> 2·2³⁰,
    "1.5G" -> 1.5·10⁹ (case-insensitive, rounded down to whole bytes; must be positive)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", str(text))
        unit = match[2].upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{text!r} is not a size; write e.g. 5GB, 500MB, 2GiB or 1000000")
        try:  # Decimal: "1.1GB" is exactly 1_100_000_000, not 1_100_000_000.0000002
            value = int(Decimal(match[1]) * _UNITS[unit])
        except InvalidOperation:
            raise ValueError(f"{text!r} is not a size") from None
    if value <= 0:
        raise ValueError(f"{text!r}: a size must be a positive number of bytes")
    return value


@cache
def _dtype_rank() -> dict[torch.dtype, int]:
    """The order in which the installed safetensors lays out dtypes (it sorts by dtype, widest
    first, then by name), asked of the library once rather than copied from its source."""
    from safetensors.torch import save

    blob = save({name: torch.zeros(1, dtype=dtype) for name, dtype in DTYPES.items()})
    header = json.loads(blob[8: 8 + struct.unpack("<Q", blob[:8])[0]])
    starts = {DTYPES[n]: info["data_offsets"][0] for n, info in header.items()
              if n != "__metadata__"}
    return {dtype: rank for rank, dtype in enumerate(sorted(starts, key=starts.__getitem__))}


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def shard_layout(tensors: list[Planned], metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """The 8-byte length + header of one shard, and each tensor's absolute byte offset in it."""
    ordered = sorted(tensors, key=lambda t: (_dtype_rank()[t[1]], t[0]))
    header: dict = {"__metadata__": metadata}
    relative, cursor = {}, 0
    for name, dtype, shape in ordered:
        size = _nbytes(dtype, shape)
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [cursor, cursor + size]}
        relative[name], cursor = cursor, cursor + size
    # serde_json's compact form, raw UTF-8; padded with spaces to a multiple of 8 like safetensors
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {n: start + o for n, o in relative.items()}


class ShardedWriter:
    """Write the planned tensors into `directory` as shards of at most `max_shard_bytes` (a
    single tensor larger than that gets a shard of its own)."""

    def __init__(self, directory: Path, planned: list[Planned], *,
                 max_shard_bytes: int = 5 * 2**30, metadata: dict[str, str] | None = None):
        self.directory = Path(directory)
        self._planned = {name: (dtype, tuple(shape)) for name, dtype, shape in planned}
        if len(self._planned) != len(planned):
            raise OutputError("the plan names an output tensor twice")
        for name, (dtype, _) in self._planned.items():
            if dtype not in DTYPE_NAMES:
                raise OutputError(f"tensor {name!r}: safetensors cannot store dtype {dtype}")
        groups: list[list[Planned]] = [[]]
        size = 0
        for name, (dtype, shape) in self._planned.items():  # shards follow plan order
            nbytes = _nbytes(dtype, shape)
            if groups[-1] and size + nbytes > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append((name, dtype, shape))
            size += nbytes
        n = len(groups)
        names = ["model.safetensors"] if n == 1 else [
            f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        self._files = [self.directory / name for name in names]
        self._where: dict[str, tuple[int, int]] = {}  # name -> (shard index, byte offset)
        self._fds: list[int] = []
        self._written: set[str] = set()
        self._closed = False
        try:
            for index, (file, group) in enumerate(zip(self._files, groups, strict=True)):
                header, offsets = shard_layout(group, {"format": "pt", **(metadata or {})})
                fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)  # & ~umask
                self._fds.append(fd)
                # pre-sized: the file has its final length before any tensor is written
                os.ftruncate(fd, len(header) + sum(_nbytes(d, s) for _, d, s in group))
                _pwrite_all(fd, memoryview(header), 0)
                self._where |= {name: (index, offset) for name, offset in offsets.items()}
        except OSError as exc:
            self._release()
            if exc.errno in NO_SPACE:
                raise self._no_space(exc, "creating the shards", self.total_bytes) from None
            raise OutputError(f"cannot create shards in {self.directory}: {exc}") from None

    @property
    def shard_files(self) -> list[Path]:
        return list(self._files)

    @property
    def total_bytes(self) -> int:
        """Tensor bytes over all shards (the index's total_size), headers excluded."""
        return sum(_nbytes(dtype, shape) for dtype, shape in self._planned.values())

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Put one planned tensor's bytes at its offset; tensors may come in any order."""
        shard, offset = self._slot(name, tensor.dtype, tuple(tensor.shape))
        self._put(name, shard, lambda: _pwrite_all(self._fds[shard], _raw_bytes(tensor), offset))

    def copy(self, name: str, stored: TensorMeta) -> None:
        """Put a stored tensor's bytes (`CheckpointReader.stored`) at planned tensor `name`'s
        offset, unchanged, by the kernel."""
        shard, offset = self._slot(name, stored.dtype, stored.shape)
        try:
            src = os.open(stored.file, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{stored.file}: cannot read tensor {stored.name!r}: "
                                  f"{exc.strerror}") from None
        try:
            self._put(name, shard, lambda: _copy_range(src, stored.offset, self._fds[shard],
                                                       offset, stored.nbytes, stored))
        finally:
            os.close(src)

    def _slot(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int]:
        """(shard index, byte offset) of planned tensor `name`, checked against what comes."""
        if self._closed:
            raise OutputError(f"tensor {name!r}: the writer is closed")
        if name not in self._planned:
            raise OutputError(f"tensor {name!r} is not in the plan")
        if name in self._written:
            raise OutputError(f"tensor {name!r} was already written")
        planned_dtype, planned_shape = self._planned[name]
        if dtype != planned_dtype or shape != planned_shape:
            raise OutputError(f"tensor {name!r}: planned {planned_dtype} {list(planned_shape)}, "
                              f"got {dtype} {list(shape)}")
        return self._where[name]

    def _put(self, name: str, shard: int, put: Callable[[], None]) -> None:
        try:
            put()
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise OutputError(f"cannot write {self._files[shard]}: {exc.strerror}") from None
            left = self.total_bytes - sum(_nbytes(*self._planned[n]) for n in self._written)
            raise self._no_space(exc, f"writing {name!r}", left) from None
        self._written.add(name)

    def _no_space(self, exc: OSError, doing: str, left: int) -> NoSpaceLeft:
        return NoSpaceLeft(self.directory, exc.strerror, doing, left)

    def close(self) -> None:
        """Check every tensor was written, fsync, and write the index when there are shards."""
        if self._closed:
            return
        missing = [n for n in self._planned if n not in self._written]
        if missing:
            self._release()
            shown = ", ".join(repr(n) for n in missing[:10])
            more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
            were = "was" if len(missing) == 1 else "were"
            raise OutputError(f"{plural(len(missing), 'planned tensor')} {were} never written: "
                              f"{shown}{more}")
        try:
            for fd in self._fds:
                os.fsync(fd)  # delayed allocation may report ENOSPC only now
        except OSError as exc:
            self._release()
            raise OutputError(f"cannot write the shards in {self.directory}: "
                              f"{exc.strerror}") from None
        self._release()
        if len(self._files) > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {n: self._files[self._where[n][0]].name
                                    for n in self._planned}}
            (self.directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")

    def _release(self) -> None:
        self._closed = True
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # the build failed: keep its error, not a "tensors missing" one
            self._release()


def finite(name: str, tensor: torch.Tensor, whence: str) -> torch.Tensor:
    """`tensor` as it is, or an OutputError when it holds NaN / Inf: what `build` refuses
    without --allow-non-finite, refused too by the commands that remake a model's tensors
    (extend, extract, shrink, export). `whence`: where its values came from."""
    refuse_non_finite(name, count_non_finite(tensor), whence)
    return tensor


def refuse_non_finite(name: str, bad: int, whence: str) -> None:
    """`finite`'s refusal, for a tensor whose `bad` NaN / Inf values were counted elsewhere."""
    if bad:
        raise OutputError(f"output check failed: tensor {name!r} would hold {bad} NaN/Inf "
                          f"values ({whence}); nothing was written")


def overwrite_tensors(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace tensors of the .safetensors files in `directory` in place, each by one of its
    shape (cast to its dtype): only their bytes change, at their offsets. `build` fits
    calibrated routers on the model it has just written and patches them in, rather than
    writing the whole model twice."""
    metas = {}
    for file in sorted(directory.glob("*.safetensors")):
        metas |= read_safetensors_header(file)
    if (directory / "config.json").is_file():  # an MoE stored fused: its classic names
        _, metas = classic_view(read_config(directory), metas, str(directory))
    for name, tensor in tensors.items():
        if name not in metas:
            raise OutputError(f"tensor {name!r} is not in {directory}")
        if tuple(tensor.shape) != metas[name].shape:
            raise OutputError(f"tensor {name!r}: {directory} holds {list(metas[name].shape)}, "
                              f"got {list(tensor.shape)}")
    for file in {metas[name].file for name in tensors}:
        fd = os.open(file, os.O_WRONLY)
        try:
            for name, tensor in tensors.items():
                if metas[name].file == file:
                    _pwrite_all(fd, _raw_bytes(tensor.to(metas[name].dtype)), metas[name].offset)
            os.fsync(fd)
        except OSError as exc:
            raise OutputError(f"cannot write {file}: {exc.strerror}") from None
        finally:
            os.close(fd)


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """[numel] -> [numel · itemsize] raw bytes; works for bf16 / fp8, which numpy lacks."""
    return memoryview(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:  # pwrite may write fewer bytes than asked for
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


# copy_file_range refused: across file systems on old kernels, by some file systems, or absent
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.ETXTBSY}
COPY_BUFFER = 16 * 2**20


def _copy_range(src: int, src_offset: int, dst: int, dst_offset: int, size: int,
                stored: TensorMeta) -> None:
    """`size` bytes from `src` at `src_offset` to `dst` at `dst_offset`: by the kernel where it
    can, else through one reused buffer. `stored`: what is copied, for the error when the
    source file is shorter than its header said (it changed since it was opened)."""
    def ended_early() -> CheckpointError:
        return CheckpointError(f"{stored.file} ended early while reading {stored.name!r}")

    while size:
        try:
            done = os.copy_file_range(src, dst, size, src_offset, dst_offset)
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY:
                raise
            break
        if done == 0:
            raise ended_early()
        src_offset, dst_offset, size = src_offset + done, dst_offset + done, size - done
    buffer = memoryview(bytearray(min(size, COPY_BUFFER)))
    while size:
        got = os.preadv(src, [buffer[:min(size, COPY_BUFFER)]], src_offset)
        if got == 0:
            raise ended_early()
        _pwrite_all(dst, buffer[:got], dst_offset)
        src_offset, dst_offset, size = src_offset + got, dst_offset + got, size - got
