"""Read a checkpoint directory: config and tensor headers up front, tensor data one at a time.

Safetensors headers are parsed by hand (8-byte length, JSON), so planning a build reads no
tensor data and a truncated or corrupt file is caught before any work starts. Data is read
through `safe_open` handles kept in a small LRU: a mapped file counts in RSS until its handle
closes, so only `max_open_files` stay open.
"""

from __future__ import annotations

import json
import math
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from moemerge.errors import CheckpointError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
PICKLE_NAMES = ("pytorch_model.bin.index.json", "pytorch_model.bin")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_safetensors_header(file: Path) -> dict[str, TensorMeta]:
    """Tensor metadata of one .safetensors file, validated against the file's size."""
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
            header = json.loads(f.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: cannot read the safetensors header: {exc}") from None
    data_size = size - 8 - length
    metas = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{file}: tensor {name!r} has unknown dtype {info.get('dtype')}")
        end = info["data_offsets"][1]
        if end > data_size:
            raise CheckpointError(
                f"{file} is truncated: tensor {name!r} needs bytes up to {end} of the data "
                f"section but the file has {data_size}. Download or copy it again."
            )
        metas[name] = TensorMeta(name, dtype, tuple(info["shape"]), file)
    return metas


class CheckpointReader:
    """A checkpoint directory opened header-only; `read(name)` loads one tensor."""

    def __init__(self, directory: Path, *, allow_pickle: bool = False, max_open_files: int = 2):
        self.directory = Path(directory)
        self.allow_pickle = allow_pickle
        self.max_open_files = max_open_files
        self._handles: OrderedDict[Path, object] = OrderedDict()
        self.config = self._read_config()
        self.metas: dict[str, TensorMeta] = {}
        for file in self._weight_files():
            metas = read_safetensors_header(file) if file.suffix == ".safetensors" else \
                self._pickle_metas(file)
            for name, meta in metas.items():
                if name in self.metas:
                    raise CheckpointError(
                        f"tensor {name!r} is in both {self.metas[name].file} and {file}"
                    )
                self.metas[name] = meta

    def _read_config(self) -> dict:
        file = self.directory / "config.json"
        if not self.directory.is_dir():
            raise CheckpointError(f"model directory {self.directory} does not exist")
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: a model directory needs its config.json")
        try:
            return json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{file} is not valid JSON: {exc}") from None

    def _weight_files(self) -> list[Path]:
        for index_name in ("model.safetensors.index.json", PICKLE_NAMES[0]):
            index = self.directory / index_name
            if index.is_file():
                return self._indexed_files(index)
        found = sorted(self.directory.glob("*.safetensors"))
        if found:
            return found
        pickles = sorted(self.directory.glob("*.bin"))
        if pickles:
            return [self._check_pickle(p) for p in pickles]
        raise CheckpointError(f"{self.directory} holds no weights (*.safetensors or *.bin)")

    def _indexed_files(self, index: Path) -> list[Path]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} is not a valid index: {exc}") from None
        files = [self.directory / f for f in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{file} is listed in {index.name} but missing")
        return [self._check_pickle(f) if f.suffix == ".bin" else f for f in files]

    def _check_pickle(self, file: Path) -> Path:
        if not self.allow_pickle:
            raise CheckpointError(
                f"{file} is a pickled checkpoint; loading a pickle can run arbitrary code. "
                "Convert it to safetensors, or pass --allow-pickle if you trust it (it is then "
                "loaded with weights_only=True)."
            )
        return file

    def _pickle_metas(self, file: Path) -> dict[str, TensorMeta]:
        state = self._handle(file)
        return {n: TensorMeta(n, t.dtype, tuple(t.shape), file) for n, t in state.items()}

    def _handle(self, file: Path):
        if file in self._handles:
            self._handles.move_to_end(file)
            return self._handles[file]
        while len(self._handles) >= self.max_open_files:
            _, old = self._handles.popitem(last=False)
            if hasattr(old, "__exit__"):
                old.__exit__(None, None, None)
        try:
            if file.suffix == ".safetensors":
                handle = safe_open(str(file), "pt").__enter__()
            else:
                handle = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # any failure to open is this file's fault
            raise CheckpointError(f"{file}: cannot open: {exc}") from None
        self._handles[file] = handle
        return handle

    def names(self) -> list[str]:
        return list(self.metas)

    def __contains__(self, name: str) -> bool:
        return name in self.metas

    def meta(self, name: str) -> TensorMeta:
        try:
            return self.metas[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is not in {self.directory}") from None

    def read(self, name: str) -> torch.Tensor:
        meta = self.meta(name)
        handle = self._handle(meta.file)
        if meta.file.suffix == ".safetensors":
            return handle.get_tensor(name)
        return handle[name].clone()

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.metas.values())

    def close(self) -> None:
        while self._handles:
            _, handle = self._handles.popitem()
            if hasattr(handle, "__exit__"):
                handle.__exit__(None, None, None)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
