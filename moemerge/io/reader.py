"""Read a checkpoint directory: config and tensor headers up front, tensor data one at a time.

Safetensors headers are parsed by hand (8-byte little-endian length, then JSON), so planning a
build reads no tensor data and a truncated or corrupt file is caught before any work starts.
An MoE stored fused (transformers 5's names) is shown in the classic form, each expert a byte
range of its stack (architectures/forms.py). Tensor data is read with pread (`os.preadv`)
straight into each tensor's own memory, through file descriptors kept in a small LRU
(`max_open_files`); nothing is memory-mapped, so a model streamed through does not count in
RSS (see `RawFile`). Pickled .bin files (--allow-pickle) are the exception:
`torch.load(mmap=True)`, each tensor copied out of the mapping.

A tensor that goes to the output unchanged is not read at all: `stored(name)` gives its byte
range, the writer has the kernel copy it (io/writer.py), and `count_non_finite_stored` checks
its values through a read-only mapping of the page cache, a window at a time.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moemerge import buffers
from moemerge.architectures.forms import classic_view
from moemerge.errors import CheckpointError
from moemerge.io import jsontext
from moemerge.io.paths import check_no_link_loops, check_tree_confined, confined
from moemerge.merge.primitives import count_non_finite

# safetensors dtype strings -> torch dtypes (the writer uses the inverse map)
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    offset: int = -1  # absolute byte offset of the data in a .safetensors file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit; a larger claim is not a header


def read_safetensors_header(file: Path) -> dict[str, TensorMeta]:
    """Tensor metadata of one .safetensors file in data order, validated against its size:
    every entry well-formed, and the tensors' byte ranges tiling the data exactly (an overlap
    or a gap would silently give wrong weights)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{file} is truncated or empty ({size} bytes)")
            (length,) = struct.unpack("<Q", prefix)
            if length > size - 8:
                raise CheckpointError(
                    f"{file} is truncated or not a safetensors file: its header claims "
                    f"{length} bytes but the file has {size}"
                )
            if length > MAX_HEADER_BYTES:
                raise CheckpointError(f"{file}: its header claims {length} bytes, more than "
                                      f"the {MAX_HEADER_BYTES} a safetensors header may have")
            header = jsontext.loads(f.read(length))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{file}: cannot read the safetensors header: {exc}") from None
    except RecursionError:  # JSON nested thousands deep
        raise CheckpointError(f"{file}: the safetensors header is nested too deeply") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object")
    data_size = size - 8 - length  # offsets are relative to the end of the header
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype_name, shape, (start, end) = _header_entry(file, name, info)
        dtype = DTYPES.get(dtype_name)
        if dtype is None:
            raise CheckpointError(f"{file}: tensor {name!r} has unknown dtype {dtype_name[:20]!r}")
        if end > data_size:
            raise CheckpointError(
                f"{file} is truncated: tensor {name!r} needs bytes up to {end} but the file has "
                f"{data_size} (after the header). Download or copy it again."
            )
        meta = TensorMeta(name, dtype, shape, file, 8 + length + start)
        if not 0 <= start <= end or end - start != meta.nbytes:
            raise CheckpointError(f"{file}: tensor {name!r} has data_offsets [{start}, {end}] "
                                  f"that do not fit its shape {list(shape)} and dtype {dtype_name}")
        entries.append((start, end, meta))
    entries.sort(key=lambda e: (e[0], e[1]))
    _check_tiling(file, [(s, e, m.name) for s, e, m in entries], data_size)
    return {meta.name: meta for _, _, meta in entries}


def _header_entry(file: Path, name: str, info: object) -> tuple[str, tuple[int, ...], tuple]:
    """(dtype, shape, (start, end)) of one header entry, every field of its JSON type."""
    def integer(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if isinstance(info, dict):
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if (isinstance(dtype, str) and isinstance(shape, list) and all(map(integer, shape))
                and isinstance(offsets, list) and len(offsets) == 2
                and all(map(integer, offsets))):
            return dtype, tuple(shape), tuple(offsets)
    raise CheckpointError(f"{file}: malformed header entry for tensor {name[:200]!r} (needs "
                          "dtype: string, shape: list of ints, data_offsets: [int, int])")


def _check_tiling(file: Path, ranges: list[tuple[int, int, str]], data_size: int) -> None:
    """Sorted byte ranges must follow each other with no overlap and no gap, and fill the data."""
    cursor, previous = 0, None
    for start, end, name in ranges:
        if start != cursor:
            what = "overlaps" if start < cursor else "leaves a gap after"
            after = f"tensor {previous!r}" if previous is not None else "the header"
            raise CheckpointError(f"{file}: tensor {name!r} (bytes [{start}, {end}]) {what} "
                                  f"{after} (which ends at {cursor}); the file is corrupt or "
                                  "crafted, its weights cannot be trusted")
        cursor, previous = end, name
    if cursor != data_size:
        raise CheckpointError(f"{file}: {data_size - cursor} bytes after the last tensor "
                              f"({previous!r}) belong to no tensor; the file is corrupt")


def read_config(directory: Path) -> dict:
    """A model directory's config.json as a dict; CheckpointError naming the file otherwise."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"model directory {directory} does not exist")
    file = directory / "config.json"
    if file.is_symlink():  # a loop: named as one, not as a missing file
        confined(Path(file.name), directory)
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: a model directory needs its config.json")
    confined(Path(file.name), directory)
    try:
        config = jsontext.loads(file.read_text())
    except jsontext.HugeNumber as exc:
        raise CheckpointError(f"{file}: {exc}") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{file} is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file} is not a JSON object")
    return config


def indexed_files(index: Path, directory: Path) -> list[Path]:
    """The shards an index's weight_map names, each inside `directory` (links resolved)."""
    confined(Path(index).absolute(), directory, "index")
    try:
        weight_map = jsontext.loads(index.read_text())["weight_map"]
    except KeyError:
        raise CheckpointError(f"{index} is not a valid index: it has no weight_map (which "
                              "tensor is in which file)") from None
    except (OSError, UnicodeDecodeError, ValueError, TypeError, RecursionError) as exc:
        raise CheckpointError(f"{index} is not a valid index: {str(exc)[:200]}") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) and f and n for n, f in weight_map.items()):
        raise CheckpointError(f"{index} is not a valid index: its weight_map must map "
                              "tensor names to file names")
    if not weight_map:
        raise CheckpointError(f"{index} is not a valid index: its weight_map lists no tensor")
    files = sorted(confined(Path(f), directory, f"file listed in {index.name}")
                   for f in set(weight_map.values()))
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"shard {file} is listed in {index.name} but missing")
    return files


def check_model_dir_confined(directory: Path) -> None:
    """Before transformers loads local `directory`: every file in it and every shard its
    indexes name stays inside it (or its hub blob store), as CheckpointReader requires."""
    check_tree_confined(directory, directory)
    for index in (SAFETENSORS_INDEX, PICKLE_INDEX):
        if (directory / index).is_file():
            indexed_files(directory / index, directory)


class CheckpointReader:
    """A checkpoint directory opened header-only; `read(name)` loads one tensor."""

    def __init__(self, directory: Path, *, allow_pickle: bool = False, max_open_files: int = 2,
                 per_expert: bool = False):
        self.directory = Path(directory)
        self.allow_pickle = allow_pickle
        self.max_open_files = max(1, max_open_files)
        self._handles: OrderedDict[Path, Any] = OrderedDict()  # LRU: oldest first
        if self.directory.is_dir():
            check_no_link_loops(self.directory)
        self.config = read_config(self.directory)
        self.metas: dict[str, TensorMeta] = {}
        for file in self._weight_files():
            if file.suffix == ".safetensors":
                metas = read_safetensors_header(file)
            else:
                metas = self._pickle_metas(file)
            for name, meta in metas.items():
                if name in self.metas:
                    raise CheckpointError(
                        f"tensor {name!r} is in both {self.metas[name].file} and {file}")
                self.metas[name] = meta
        # an MoE in transformers 5's fused form is read under its classic names; `form` says
        # which it is on disk (None: not an MoE layout moemerge knows), `on_disk` its names;
        # `per_expert`: GraniteMoE's classic stacks split too (forms.classic_view)
        self.on_disk = self.metas
        self.form, self.metas = classic_view(self.config, self.metas, str(self.directory),
                                             per_expert)

    def _weight_files(self) -> list[Path]:
        """The weight files, each inside the directory (links resolved; a hub snapshot's
        blob store allowed) and each pickle refused unless allowed, however it is listed."""
        d = self.directory.absolute()  # the files below are joined to it once, not twice
        # safetensors first: hub repos often carry both formats, and the .bin index is a .json
        if (d / SAFETENSORS_INDEX).is_file():
            files = indexed_files(d / SAFETENSORS_INDEX, d)
        elif (single := d / "model.safetensors").is_file():
            files = [single]
        elif found := sorted(d.glob("*.safetensors")):
            files = found
        elif (d / PICKLE_INDEX).is_file():
            files = indexed_files(d / PICKLE_INDEX, d)
        elif (d / "pytorch_model.bin").is_file():
            files = [d / "pytorch_model.bin"]
        elif not (files := sorted(d.glob("*.bin"))):
            raise CheckpointError(f"{d} holds no weights (*.safetensors or *.bin)")
        files = [confined(f, d, "weight file") for f in files]
        return [f if f.suffix == ".safetensors" else self._check_pickle(f) for f in files]

    def _check_pickle(self, file: Path) -> Path:
        if not self.allow_pickle:
            raise CheckpointError(
                f"{file} is a pickled checkpoint; pickles can run code when loaded. Convert it "
                "to safetensors, or pass --allow-pickle if you trust it (it is then loaded with "
                "weights_only=True)."
            )
        return file

    def _pickle_metas(self, file: Path) -> dict[str, TensorMeta]:
        state = self._handle(file)
        if not isinstance(state, dict):
            raise CheckpointError(f"{file} does not hold a state dict")
        return {n: TensorMeta(n, t.dtype, tuple(t.shape), file)
                for n, t in state.items() if isinstance(t, torch.Tensor)}

    def _handle(self, file: Path) -> Any:
        """An open `RawFile` (or a memory-mapped pickle's dict), least recently used closed
        first."""
        if file in self._handles:
            self._handles.move_to_end(file)
            return self._handles[file]
        while len(self._handles) >= self.max_open_files:
            _close(self._handles.popitem(last=False)[1])
        try:
            if file.suffix == ".safetensors":
                handle = RawFile(file)
            else:
                handle = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # any failure to open is this file's fault
            raise CheckpointError(f"{file}: cannot open: {exc}") from None
        self._handles[file] = handle
        return handle

    def names(self) -> list[str]:
        return list(self.metas)

    def __contains__(self, name: object) -> bool:
        return name in self.metas

    def meta(self, name: str) -> TensorMeta:
        try:
            return self.metas[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is not in {self.directory}") from None

    def stored(self, name: str) -> TensorMeta | None:
        """Where tensor `name`'s bytes lie, when a byte copy of them is the tensor (a
        .safetensors file: raw little-endian data at `offset`); None for a pickle."""
        meta = self.meta(name)
        return meta if meta.offset >= 0 else None

    def read(self, name: str) -> torch.Tensor:
        """One tensor, owning its memory (safe after the file's handle closes)."""
        meta = self.meta(name)
        handle = self._handle(meta.file)
        try:
            if meta.file.suffix == ".safetensors":
                return handle.read(meta)
            return handle[name].clone()  # the pickle's tensor is a view of the mmap
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{meta.file}: cannot read tensor {name!r}: {exc}") from None

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.metas.values())

    def close(self) -> None:
        while self._handles:
            _close(self._handles.popitem()[1])

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DerivedReader:
    """The reader interface (names, meta, total_bytes, a context manager that closes nothing)
    of a checkpoint another reader presents in place (io/moe_expert.ExpertReader,
    io/adapter.AdapterReader), over its `metas`; the reader it wraps is closed by its owner."""

    metas: dict[str, TensorMeta]
    directory: Path
    whose = ""  # what a missing tensor's error says it is not in, after the directory

    def names(self) -> list[str]:
        return list(self.metas)

    def __contains__(self, name: object) -> bool:
        return name in self.metas

    def meta(self, name: str) -> TensorMeta:
        if name not in self.metas:
            raise CheckpointError(f"tensor {name!r} is not in {self.directory}{self.whose}")
        return self.metas[name]

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.metas.values())

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _close(handle: Any) -> None:
    if isinstance(handle, RawFile):  # a pickle's dict just loses its last reference
        handle.close()


class RawFile:
    """A .safetensors file read with pread straight into each tensor's own memory.

    Not mmap: mapped pages count in the process's RSS until the mapping closes, so streaming
    a model through a mapping looks (and, under memory pressure, acts) like holding all of it;
    pread leaves them in the page cache, where the kernel can drop them."""

    def __init__(self, file: Path):
        self.file = file
        self.fd = os.open(file, os.O_RDONLY)

    def read(self, meta: TensorMeta) -> torch.Tensor:
        out = buffers.empty(meta.shape, meta.dtype)  # a build's pool: no fresh pages
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())  # little-endian, as on disk
        offset = meta.offset
        while view.nbytes:
            done = os.preadv(self.fd, [view], offset)
            if done == 0:
                raise CheckpointError(f"{self.file} ended early while reading {meta.name!r}")
            view, offset = view[done:], offset + done
        return out

    def close(self) -> None:
        os.close(self.fd)


MAP_WINDOW = 64 * 2**20  # bytes mapped at once: a 500 MiB embedding never counts whole in RSS


def count_non_finite_stored(meta: TensorMeta) -> int:
    """`count_non_finite` of a stored tensor, read through read-only shared mappings of its
    file (page-cache pages, prefaulted; nothing copied, no anonymous memory), a window at a
    time. For tensors copied unchanged, whose bytes never enter this process otherwise."""
    if not meta.dtype.is_floating_point:
        return 0
    window = MAP_WINDOW - MAP_WINDOW % meta.dtype.itemsize
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # Linux: one fault per window
    bad = 0
    try:
        with open(meta.file, "rb") as f:
            for first in range(meta.offset, meta.offset + meta.nbytes, window):
                size = min(window, meta.offset + meta.nbytes - first)
                start = first - first % mmap.ALLOCATIONGRANULARITY
                with mmap.mmap(f.fileno(), first + size - start, flags=flags,
                               prot=mmap.PROT_READ, offset=start) as mapped:
                    with warnings.catch_warnings():  # read-only: torch warns it is not writable
                        warnings.simplefilter("ignore", UserWarning)
                        values = torch.frombuffer(mapped, dtype=torch.uint8, count=size,
                                                  offset=first - start).view(meta.dtype)
                    bad += count_non_finite(values)
                    del values  # the mapping closes only when no tensor holds it
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{meta.file}: cannot read tensor {meta.name!r}: {exc}") from None
    return bad
