"""Write the trained model as a complete model directory in the layout it came in.

The source is re-read tensor by tensor with its own names, dtypes and order: a trained tensor is
written from the in-memory parameter (mapped back to its on-disk name, cast to the source
dtype), every other one from the source's bytes, so untrained tensors are bitwise unchanged, and
classic per-expert names stay classic, fused stacks fused. config.json, tokenizer, model card,
remote code (*.py) and every other side file are copied as they are. Written through
`atomic_output_dir`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from moemerge.architectures.forms import layout_of
from moemerge.io.atomic import atomic_output_dir
from moemerge.io.paths import check_tree_confined
from moemerge.io.reader import PICKLE_INDEX, SAFETENSORS_INDEX, CheckpointReader
from moemerge.io.tensor_list import DenseTensor, written_in
from moemerge.io.writer import ShardedWriter
from moemerge.train.params import to_disk_names

WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth"}
SKIP = {SAFETENSORS_INDEX, PICKLE_INDEX}
TRAINING_DIR = "training"


def trained_tensors(model: torch.nn.Module, names: list[str],
                    reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """{on-disk name: trained value} for the trainable parameters `names`."""
    params = dict(model.named_parameters())
    tensors = {n: params[n].detach().to("cpu", torch.float32) for n in names}
    disk = {n: (m.dtype, m.shape) for n, m in reader.metas.items()}
    return to_disk_names(model, tensors, disk, reader.config)


def export(model: torch.nn.Module, names: list[str], source: Path, out: Path, *, force: bool,
           extra: Callable[[Path], None]) -> dict[str, torch.Tensor]:
    """Write OUT; `extra(tmp_dir)` adds the training reports before the rename. Returns the
    trained tensors as written (on-disk names and dtypes)."""
    with CheckpointReader(source) as reader:
        trained = trained_tensors(model, names, reader)
        metas = list(reader.metas.values())
        per_file: dict[Path, int] = {}
        for m in metas:
            per_file[m.file] = per_file.get(m.file, 0) + m.nbytes
        written = {name: value.to(reader.meta(name).dtype) for name, value in trained.items()}
        tensors = [DenseTensor(m.name, m.dtype, m.shape,
                               (lambda v=written[m.name]: v) if m.name in written
                               else (lambda n=m.name: reader.read(n))) for m in metas]
        # an MoE stored fused (transformers 5's names) is written back fused
        tensors = written_in(reader.form, layout_of(reader.config), tensors)
        planned = [(t.name, t.dtype, t.shape) for t in tensors]
        with atomic_output_dir(out, force=force, size=reader.total_bytes) as tmp:
            # shards no larger than the source's largest: the same number of files or close
            with ShardedWriter(tmp, planned, max_shard_bytes=max(per_file.values())) as writer:
                for t in tensors:
                    writer.write(t.name, t.make())
            _copy_side_files(Path(source), tmp)
            (tmp / TRAINING_DIR).mkdir(exist_ok=True)
            extra(tmp)
    return written


def _copy_side_files(source: Path, dst: Path) -> None:
    """Everything in the model directory but the weights (and their index), as it is; a file
    or directory that links outside the model directory is refused."""
    for path in sorted(source.iterdir()):
        if (path.name in SKIP or path.name == TRAINING_DIR or path.suffix in WEIGHT_SUFFIXES
                or path.name.startswith(".")):
            continue
        check_tree_confined(path, source)
        if path.is_dir():
            shutil.copytree(path, dst / path.name)
        else:
            shutil.copy2(path, dst / path.name)


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
