"""A streaming sharded safetensors writer: headers first, then tensors in any order.

Every shard's header is computed from the planned (name, dtype, shape) list before any data
exists, each file is created at its full size, and `write` puts a tensor's bytes at its offset:
peak memory is one tensor, and the files are byte-identical to `safetensors.torch.save_file`.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from functools import cache
from pathlib import Path

import torch

from moemerge.errors import OutputError
from moemerge.io.reader import DTYPES

Planned = tuple[str, torch.dtype, tuple[int, ...]]
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """'5GB' -> 5·10⁹, '2GiB' -> 2·2³⁰, '1.5G' -> 1.5·10⁹, 123 -> 123 (bytes)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = match[2].upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{text!r} is not a size; write e.g. 5GB, 500MB or 2GiB")
        value = int(float(match[1]) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"{text!r}: a size must be positive")
    return value


@cache
def _dtype_rank() -> dict[torch.dtype, int]:
    """The order in which safetensors lays out dtypes, asked of the installed library once."""
    from safetensors.torch import save

    blob = save({name: torch.zeros(1, dtype=dtype) for name, dtype in DTYPES.items()})
    header = json.loads(blob[8: 8 + struct.unpack("<Q", blob[:8])[0]])
    starts = {DTYPES[n]: info["data_offsets"][0] for n, info in header.items()}
    return {dtype: rank for rank, dtype in enumerate(sorted(starts, key=starts.__getitem__))}


def _layout(tensors: list[Planned], metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """The header bytes of one shard and each tensor's absolute byte offset in it."""
    ordered = sorted(tensors, key=lambda t: (_dtype_rank()[t[1]], t[0]))
    header: dict = {"__metadata__": metadata}
    relative, cursor = {}, 0
    for name, dtype, shape in ordered:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [cursor, cursor + size]}
        relative[name], cursor = cursor, cursor + size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes with spaces
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {n: start + o for n, o in relative.items()}


class ShardedWriter:
    """Write the planned tensors into `directory` as shards of at most `max_shard_bytes`."""

    def __init__(self, directory: Path, planned: list[Planned], *,
                 max_shard_bytes: int = 5 * 2**30, metadata: dict[str, str] | None = None):
        self.directory = Path(directory)
        self._planned = {name: (dtype, tuple(shape)) for name, dtype, shape in planned}
        if len(self._planned) != len(planned):
            raise OutputError("the plan names an output tensor twice")
        groups: list[list[Planned]] = [[]]
        size = 0
        for name, dtype, shape in planned:  # shards follow plan order: loaders read in order
            nbytes = math.prod(shape) * dtype.itemsize
            if groups[-1] and size + nbytes > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append((name, dtype, tuple(shape)))
            size += nbytes
        n = len(groups)
        names = ["model.safetensors"] if n == 1 else [
            f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        self.shard_files = [self.directory / name for name in names]
        self.total_bytes = sum(math.prod(s) * d.itemsize for _, d, s in planned)
        self._where: dict[str, tuple[int, int]] = {}  # name -> (shard index, byte offset)
        self._fds: list[int] = []
        self._written: set[str] = set()
        for index, (file, group) in enumerate(zip(self.shard_files, groups, strict=True)):
            header, offsets = _layout(group, {"format": "pt", **(metadata or {})})
            fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            self._fds.append(fd)
            os.ftruncate(fd, len(header) + sum(math.prod(s) * d.itemsize for _, d, s in group))
            os.pwrite(fd, header, 0)
            self._where |= {name: (index, offset) for name, offset in offsets.items()}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._planned:
            raise OutputError(f"tensor {name!r} is not in the plan")
        if name in self._written:
            raise OutputError(f"tensor {name!r} was already written")
        dtype, shape = self._planned[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise OutputError(
                f"tensor {name!r}: planned {dtype} {list(shape)}, got {tensor.dtype} "
                f"{list(tensor.shape)}"
            )
        shard, offset = self._where[name]
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        view = memoryview(data)
        while view.nbytes:  # pwrite may write less than asked for
            done = os.pwrite(self._fds[shard], view, offset)
            view, offset = view[done:], offset + done
        self._written.add(name)

    def close(self) -> None:
        missing = [n for n in self._planned if n not in self._written]
        if missing:
            self._release()
            raise OutputError(f"{len(missing)} planned tensors were never written, e.g. "
                              f"{missing[0]!r}")
        for fd in self._fds:
            os.fsync(fd)
        self._release()
        if len(self.shard_files) > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {n: self.shard_files[self._where[n][0]].name
                                    for n in self._planned}}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    def _release(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self._release()
