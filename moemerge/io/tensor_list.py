"""What an extraction writes: the dense config and, in write order, each tensor's name, dtype,
shape and a function that makes it (reading from the MoE only when the writer asks)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from moemerge.architectures.forms import FUSED, fused_tensors
from moemerge.architectures.tables import MoELayout
from moemerge.io.reader import CheckpointReader

Make = Callable[[], torch.Tensor]


@dataclass
class DenseTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Make
    source: str | None = None  # the checkpoint tensor it is, bytes unchanged (else: made)


@dataclass
class Extraction:
    """One expert of an MoE as a dense checkpoint of its source family."""

    config: dict  # the dense config.json
    tensors: list[DenseTensor] = field(default_factory=list)
    what: str = ""  # one line for the card: which FFN / stack this is

    def copy(self, reader: CheckpointReader, source: str, name: str | None = None) -> None:
        """Add MoE tensor `source` unchanged, as `name` (default: the same name)."""
        meta = reader.meta(source)
        self.tensors.append(DenseTensor(name or source, meta.dtype, meta.shape,
                                        lambda: reader.read(source), source))

    @property
    def names(self) -> set[str]:
        return {t.name for t in self.tensors}


def resolve_tie(extraction: Extraction, reader: CheckpointReader, embed: str, head: str) -> None:
    """Respect tied embeddings: when the head written equals the embedding bit for bit (a tied
    source kept tied), drop lm_head.weight and say tie_word_embeddings: true; otherwise keep
    both and say false, so transformers never ties a head that differs from the embedding."""
    tensors = {t.name: t for t in extraction.tensors}
    tied = head in tensors and embed in tensors and torch.equal(tensors[head].make(),
                                                                 tensors[embed].make())
    if tied or head not in tensors:  # no head on disk: the MoE itself computed it tied
        extraction.tensors = [t for t in extraction.tensors if t.name != head]
    extraction.config["tie_word_embeddings"] = tied or head not in tensors


def config_dtype(config: dict) -> torch.dtype:
    """The dtype a dense config.json names (torch_dtype, or transformers 5's dtype)."""
    name = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def write_order(tensor: DenseTensor) -> tuple:
    """Embedding first, then layer by layer (numerically), then the rest (norm, head)."""
    parts = tensor.name.split(".")
    if parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return (1, int(parts[2]), tensor.name)
    return (0 if "embed" in tensor.name else 2, 0, tensor.name)


def written_in(form: str | None, layout: MoELayout, tensors: list[DenseTensor]
               ) -> list[DenseTensor]:
    """`tensors` (classic names) as `form` stores them: a fused input written back fused, each
    stack [E, rows, cols] made from its experts' parts when the writer asks."""
    if form != FUSED:
        return tensors

    def stack(name: str, groups: list[list[DenseTensor]]) -> DenseTensor:
        first = groups[0][0]
        shape = (len(groups), sum(t.shape[0] for t in groups[0]), first.shape[1])
        return DenseTensor(name, first.dtype, shape, lambda: torch.stack(
            [torch.cat([t.make() for t in group]) for group in groups]))

    return fused_tensors(layout, tensors, lambda t: t.name, stack,
                         lambda t, name: replace(t, name=name))
