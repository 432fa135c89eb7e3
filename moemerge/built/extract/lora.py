"""`moemerge extract MODEL OUT --lora RANK --base BASE`: a fine-tune as a PEFT LoRA adapter.

MODEL is a dense model, or an MoE moemerge built with `--expert` (`--weights`) naming the
expert: that expert as `extract` writes it (extract/__init__.py), taken against BASE, the
dense model the adapter goes on. Module by module (the family's table names them):

- a linear of the attention or the FFN (a 2-D weight, role attn / ffn) whose weight differs
  gets LoRA factors from the truncated SVD of its task vector τ = W_model − W_base
  (merge/lowrank.py): rank RANK (at most min(out, in)), or with `auto` the smallest rank
  keeping `share` of τ's energy;
- any other module that differs (embedding, head, norms, a linear whose bias differs) is
  kept whole: peft's `modules_to_save`, exact and at full size;
- a module equal to the base's is left out.

Two passes, one module's tensors in memory at a time: the first compares each module with
the base (and, for `auto`, takes its singular values) to plan every output tensor; the second
factorises and writes. Factors are computed in float32 (on `device`) and written in MODEL's
dtype; α = r for every module, so peft's scale α/r is 1 and base + B·A is the approximation.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moemerge.architectures.tables import DenseFamily, family_for_config
from moemerge.built.extract import choose_extraction
from moemerge.built.extract.lora_files import adapter_config, card, report_json
from moemerge.errors import MismatchError, RecipeError
from moemerge.io.atomic import SIDE_FILES, atomic_output_dir, copy_side_files
from moemerge.io.reader import CheckpointReader, read_config
from moemerge.io.resolve import resolve_model
from moemerge.io.tensor_list import Extraction, write_order
from moemerge.io.writer import ShardedWriter, finite
from moemerge.merge.lowrank import energy_share, lora_factors, rank_for_share, singular_values
from moemerge.progress import Stages
from moemerge.recipe.kinds import Kind

__all__ = ["LoraExtracted", "ModuleDelta", "extract_lora"]

ADAPTER_FILE, CONFIG_FILE, REPORT_FILE = ("adapter_model.safetensors", "adapter_config.json",
                                          "lora_report.json")
LINEAR_ROLES = ("attn", "ffn")
PREFIX = "base_model.model."  # peft's name for the model inside a PeftModel
Planned = tuple[str, torch.dtype, tuple[int, ...]]
TOKENIZER_FILES = [f for f in SIDE_FILES if f != "generation_config.json"]  # the fine-tune's


@dataclass
class ModuleDelta:
    """One module that differs from the base's, and what the adapter holds of it."""

    name: str  # model.layers.0.self_attn.q_proj
    params: tuple[str, ...]  # its tensors: ("weight",), ("weight", "bias")
    lora: bool  # LoRA factors; else kept whole (modules_to_save)
    shape: tuple[int, ...]  # of its weight
    dtype: torch.dtype  # of the fine-tune's weight: what the adapter is written in
    rank: int = 0
    kept: float = 1.0  # the share of τ's energy B·A keeps (1 for a whole module)
    norm: float = 0.0  # ‖τ‖_F of its weight (LoRA modules)
    whole: tuple[Planned, ...] = ()  # a whole module's tensors: (param, dtype, shape)

    def planned(self) -> list[Planned]:
        """The adapter's tensors for this module: (name, dtype, shape)."""
        if self.lora:
            out, into = self.shape
            return [(f"{PREFIX}{self.name}.lora_A.weight", self.dtype, (self.rank, into)),
                    (f"{PREFIX}{self.name}.lora_B.weight", self.dtype, (out, self.rank))]
        return [(f"{PREFIX}{self.name}.{p}", dtype, shape) for p, dtype, shape in self.whole]

    @property
    def bytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in self.planned())


@dataclass
class LoraExtracted:
    label: str  # the model's directory name, or the expert's name
    kind: str  # dense, token_routed, seq_routed or merged_experts
    modules: list[ModuleDelta]
    unchanged: int  # modules equal to the base's, left out
    adapter_bytes: int
    model_bytes: int
    seconds: float = 0.0


class Pair:
    """The fine-tune's tensors and the base's under the dense names; a head that is not on
    disk (tied embeddings) reads as the embedding."""

    def __init__(self, tuned: Extraction, base: CheckpointReader, family: DenseFamily,
                 where: tuple[str, str]):
        self.tuned = {t.name: t for t in sorted(tuned.tensors, key=write_order)}
        self.base = base
        roles = {role: name for name, role in family.tensors.items()}
        self.embed, self.head = roles.get("embed"), roles.get("lm_head")
        tuned_names = self._tied(set(self.tuned))
        base_names = self._tied(set(base.names()))
        if tuned_names != base_names:
            only = sorted(tuned_names - base_names)[:4], sorted(base_names - tuned_names)[:4]
            raise MismatchError(f"{where[0]} and the base {where[1]} hold different tensors: "
                                f"only in the model {only[0]}, only in the base {only[1]}; "
                                "an adapter goes on a base of the same architecture")
        self.names = [*self.tuned, *sorted(tuned_names - set(self.tuned))]  # a tied head last

    def _tied(self, names: set[str]) -> set[str]:
        return names | {self.head} if self.embed in names and self.head else names

    def stored(self, name: str, side: dict | CheckpointReader) -> str:
        return self.embed if name == self.head and name not in side else name

    def read(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        tuned = self.tuned[self.stored(name, self.tuned)].make()
        base = self.base.read(self.stored(name, self.base))
        if tuple(tuned.shape) != tuple(base.shape):
            raise MismatchError(f"{name}: {list(tuned.shape)} in the model, "
                                f"{list(base.shape)} in the base (resize the base's vocabulary "
                                "first if the fine-tune added tokens)")
        return tuned, base


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == b.dtype:
        return torch.equal(a, b)
    return all(torch.equal(x.float(), y.float()) for x, y in zip(a.split(4096), b.split(4096),
                                                                  strict=True))


def plan_modules(pair: Pair, family: DenseFamily, rank: int | None, share: float,
                 device: torch.device) -> tuple[list[ModuleDelta], int]:
    """(the modules that differ, in write order; the count of those that do not)."""
    groups: dict[str, list[str]] = {}
    for name in pair.names:
        module, _, param = name.rpartition(".")
        groups.setdefault(module, []).append(param)
    modules, unchanged = [], 0
    for module, params in groups.items():
        pairs = {p: pair.read(f"{module}.{p}") for p in params}
        changed = [p for p, (tuned, base) in pairs.items() if not _equal(tuned, base)]
        if not changed:
            unchanged += 1
            continue
        weight = pairs["weight" if "weight" in pairs else params[0]][0]
        role = family.classify(f"{module}.weight")
        lora = changed == ["weight"] and weight.ndim == 2 and role is not None and \
            role.role in LINEAR_ROLES
        found = ModuleDelta(module, tuple(params), lora, tuple(weight.shape), weight.dtype)
        if lora:
            found.rank = min(rank, *weight.shape) if rank is not None else rank_for_share(
                singular_values(_delta(*pairs["weight"], device)), share)
        else:
            found.whole = tuple((p, t.dtype, tuple(t.shape)) for p, (t, _) in pairs.items())
        modules.append(found)
    return modules, unchanged


def _delta(tuned: torch.Tensor, base: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tuned.to(device, torch.float32) - base.to(device, torch.float32)


def write_module(module: ModuleDelta, pair: Pair, writer: ShardedWriter,
                 device: torch.device) -> None:
    """Factorise (or copy) one module into the adapter; records its rank's kept share."""
    if not module.lora:
        for param in module.params:
            name = f"{PREFIX}{module.name}.{param}"
            writer.write(name, finite(name, pair.read(f"{module.name}.{param}")[0].contiguous(),
                                      "the model"))
        return
    a, b, s = lora_factors(_delta(*pair.read(f"{module.name}.weight"), device), module.rank)
    module.kept, module.norm = energy_share(s, module.rank), float(s.double().norm())
    for (name, dtype, _), factor in zip(module.planned(), (a, b), strict=True):
        writer.write(name, finite(name, factor.to("cpu", dtype).contiguous(),
                                  f"the SVD of {module.name}'s task vector"))


def extract_lora(model: Path, out: Path, *, base: str, rank: int | None, share: float = 0.9,
                 expert: str | None = None, weights: str | None = None,
                 device: torch.device | str = "cpu", force: bool = False,
                 progress: bool = False) -> LoraExtracted:
    """Write to `out` the adapter that takes `base` (a directory or a hub id) to `model` (a
    dense model, or with `expert` / `weights` one expert of an MoE moemerge built): rank-`rank`
    factors of each linear that differs, or (rank None) the smallest rank keeping `share` of
    its task vector's energy."""
    model, out = Path(model), Path(out)
    where = (str(model), base)
    base_dir = resolve_model(base)
    config = read_config(model)
    with CheckpointReader(model) as reader:
        if Kind.of_config(config).moe:
            if (expert is None) == (weights is None):
                raise RecipeError(f"{model} is an MoE: give --expert NAME (or an index), or "
                                  "--weights (merged_experts), not both, to say which expert "
                                  "becomes the adapter")
            kind, tuned, label = choose_extraction(model, reader, config, expert, weights)
        else:
            if expert is not None or weights is not None:
                raise RecipeError(f"--expert / --weights: {model} is a dense model, not an MoE; "
                                  "it is the adapter as it is")
            kind, label, tuned = "dense", model.name, Extraction(config)
            for name in reader.names():
                tuned.copy(reader, name)
        return write_adapter(tuned, where, base_dir, out, label=label, kind=kind, rank=rank,
                             share=share, device=device, force=force, progress=progress,
                             side_files=model)


def write_adapter(tuned: Extraction, where: tuple[str, str], base_dir: Path, out: Path, *,
                  label: str, kind: str, rank: int | None, share: float,
                  device: torch.device | str, force: bool, progress: bool,
                  side_files: Path | None = None) -> LoraExtracted:
    """The adapter from `base_dir` to `tuned`, written to `out`; `where`: (the model, the base)
    as the user named them (the base's name goes into adapter_config.json); the tokenizer
    files of `side_files` (the model's directory) are copied beside it."""
    start, device, stage = time.perf_counter(), torch.device(device), Stages(progress)
    family = family_for_config(tuned.config, where[0])
    base_family = family_for_config(read_config(base_dir), where[1])
    if base_family is not family:
        raise MismatchError(f"{where[0]} is a {family.name} model and the base {where[1]} a "
                            f"{base_family.name} one; an adapter goes on its own architecture")
    with CheckpointReader(base_dir) as base:
        pair = Pair(tuned, base, family, where)
        with stage("comparing with the base" + ("" if rank else " (singular values)")) as say:
            modules, unchanged = plan_modules(pair, family, rank, share, device)
            say(f"{sum(m.lora for m in modules)} LoRA, {sum(not m.lora for m in modules)} "
                f"whole, {unchanged} unchanged")
        if not any(m.lora for m in modules):
            whole = [m.name for m in modules]
            raise MismatchError(f"{where[0]} has no linear module that differs from the base "
                                f"{where[1]}" + (f" (only {', '.join(whole[:4])})" if whole
                                                 else ": they are equal") +
                                "; there is nothing to factorise")
        config = adapter_config(modules, pair.names, where)
        size = sum(m.bytes for m in modules)
        done = LoraExtracted(label, kind, modules, unchanged, size,
                             sum(math.prod(t.shape) * t.dtype.itemsize for t in tuned.tensors))
        with atomic_output_dir(out, force=force, size=size) as tmp:
            with ShardedWriter(tmp, [t for m in modules for t in m.planned()],
                               max_shard_bytes=2**62) as writer:
                for module in stage.bar("factorising", modules, size, len(modules),
                                        lambda m: m.bytes):
                    write_module(module, pair, writer, device)
            (tmp / writer.shard_files[0].name).rename(tmp / ADAPTER_FILE)
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
            done.seconds = time.perf_counter() - start
            (tmp / REPORT_FILE).write_text(json.dumps(report_json(done, where, rank, share),
                                                      indent=2) + "\n")
            (tmp / "README.md").write_text(card(done, where, rank, share))
            if side_files is not None:
                copy_side_files(side_files, tmp, TOKENIZER_FILES)
    return done
