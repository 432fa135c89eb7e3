"""Tiny models made offline: random checkpoints of every family, and branched toy experts.

`make_toy_experts` trains a small base on an equal mixture of the domains, then branches one
expert per domain and trains each further on its own domain only (Branch-Train-Mix's recipe):

    out_dir/
      base/                    config.json, model.safetensors, tokenizer.json, ...
      experts/<domain>/        the same, one per domain
      data/<domain>.train.txt  the text each model trained on
      data/<domain>.eval.txt   held-out text from documents disjoint from training
      toyset.json              spec, relative paths, timings, final losses (written last)

`cached_toy_experts` keeps one set per spec under $MOEMERGE_CACHE (default ~/.cache/moemerge).
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moemerge.loading import quiet_transformers
from moemerge.progress import step_lines
from moemerge.toy.cache import cached_entry, entry_path
from moemerge.toy.corpora import DOMAINS, domain_texts
from moemerge.toy.tokenizer import train_tokenizer
from moemerge.toy.train import (
    FAMILIES,
    init_model,
    make_random_model,
    model_config,
    token_stream,
    train_lm,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "FAMILIES",
    "ToySet",
    "ToySpec",
    "TINY",
    "DEMO",
    "QUALITY",
    "make_random_model",
    "make_toy_experts",
    "cached_toy_experts",
]

FORMAT_VERSION = 1  # bump when the corpora, tokenizer or training change what a spec makes
TOYSET_FILE = "toyset.json"


@dataclass(frozen=True)
class ToySpec:
    """Everything that determines a toy set; `key()` names its cache entry."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    vocab: int = 2048
    seq_len: int = 128
    # measured on 2 cores: ~95 s in all, each expert 17-23 % better on its own domain; a longer
    # base (1200 steps) leaves less to specialise (code +6 %). Expert lr 1e-3 gave 21-35 % but
    # moved attention so far that no expert's FFN worked with the averaged attention (an MoE with
    # oracle routing was worse than the base on code); at 3e-4 the built MoE beats the base on
    # every domain, as branched experts of real models do.
    base_steps: int = 500
    expert_steps: int = 500
    batch: int = 16
    lr: float = 3e-3
    expert_lr: float = 3e-4
    train_chars: int = 1_000_000  # per domain
    eval_chars: int = 40_000  # per domain
    domains: tuple[str, ...] = DOMAINS
    seed: int = 0
    family: str = "llama"
    # what an expert trains: "all" its parameters, or "ffn" only (the rest frozen at the base's,
    # as the real experts are: their FFNs then work beside the others' shared attention)
    expert_trains: str = "all"

    def key(self) -> str:
        fields = asdict(self)
        if fields["expert_trains"] == "all":  # the sets made before the field keep their keys
            del fields["expert_trains"]
        blob = json.dumps({"format": FORMAT_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


TINY = ToySpec(
    hidden=32,
    heads=4,
    kv_heads=2,
    intermediate=64,
    vocab=512,
    seq_len=64,
    base_steps=60,
    expert_steps=60,
    batch=8,
    lr=1e-2,
    expert_lr=3e-3,
    train_chars=60_000,
    eval_chars=6_000,
)
DEMO = ToySpec()
# the quality benchmark's set (benchmarks/quality): 4x the demo's compute per token (~1.5M
# parameters, 0.16 s a training step on 2 cores) and a fourth domain, so that methods separate;
# ~6 min to make. hidden 256 / 6 layers (0.57 s a step) would take the benchmark past 20 min.
QUALITY = ToySpec(
    hidden=128,
    layers=4,
    intermediate=512,
    base_steps=600,
    expert_steps=400,
    eval_chars=120_000,
    domains=(*DOMAINS, "cpp"),
)


@dataclass
class ToySet:
    """A made toy set; paths are absolute, toyset.json stores them relative to `root`."""

    root: Path
    base: Path
    experts: dict[str, Path]
    eval_text: dict[str, Path]
    train_text: dict[str, Path]
    spec: ToySpec  # or RealExpertSpec

    @classmethod
    def load(cls, root: Path, file: str = TOYSET_FILE, spec_type: type = ToySpec) -> ToySet:
        """The set whose `file` (toyset.json, or realset.json with `RealExpertSpec`) is in
        `root`."""
        meta = json.loads((root / file).read_text())
        spec = spec_type(**{**meta["spec"], "domains": tuple(meta["spec"]["domains"])})
        paths = {
            k: {d: root / p for d, p in meta[k].items()}
            for k in ("experts", "eval_text", "train_text")
        }
        return cls(root=root, base=root / meta["base"], spec=spec, **paths)


@contextmanager
def progress_bars(enabled: bool) -> Iterator[Callable[[str, int], Callable | None]]:
    """Yields task(label, total) -> on_step callback (None when progress is off): a bar per
    task on a terminal, plain lines elsewhere (moemerge.progress)."""
    if not enabled:
        yield lambda label, total: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:  # nothing redraws in a pipe: a line per phase, and now and then
        def say(line: str) -> None:
            console.print(line, markup=False, highlight=False, soft_wrap=True)

        yield lambda label, total: step_lines(say, f"training {label}", total)
        return

    columns = (
        TextColumn("{task.description:<14}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as bar:

        def task(label: str, total: int):
            tid = bar.add_task(label, total=total, loss=float("nan"))
            return lambda step, loss: bar.update(tid, completed=step + 1, loss=loss)

        yield task


def write_texts(spec, out_dir: Path, meta: dict) -> dict[str, tuple[str, str]]:
    """Write data/<domain>.{train,eval}.txt for a toy or real set's `spec` (its domains,
    train_chars, eval_chars and seed) and record their paths in `meta`; returns each domain's
    (train, held-out) text."""
    (out_dir / "data").mkdir(parents=True, exist_ok=True)
    texts = {}
    for d in spec.domains:
        texts[d] = domain_texts(d, spec.train_chars, spec.eval_chars, spec.seed)
        for split, text in zip(("train", "eval"), texts[d], strict=True):
            (out_dir / "data" / f"{d}.{split}.txt").write_text(text, encoding="utf-8")
            meta[f"{split}_text"][d] = f"data/{d}.{split}.txt"
    return texts


def train_ffns_only(model: torch.nn.Module) -> None:
    """Freeze every parameter outside the decoder layers' FFNs (`expert_trains: ffn`)."""
    for name, param in model.named_parameters():
        param.requires_grad_(".mlp." in name)


def make_toy_experts(spec: ToySpec, out_dir: Path, progress: bool = True) -> ToySet:
    """Build a toy set for `spec` in `out_dir` (see the module docstring for the layout)."""
    if spec.expert_trains not in ("all", "ffn"):
        raise ValueError(f"expert_trains: {spec.expert_trains!r} is not 'all' or 'ffn'")
    out_dir, clock, timings = Path(out_dir), time.perf_counter(), {}
    meta = {"format": FORMAT_VERSION, "spec": asdict(spec), "base": "base", "experts": {}}
    meta |= {"eval_text": {}, "train_text": {}, "final_loss": {}}
    texts = {d: train for d, (train, _) in write_texts(spec, out_dir, meta).items()}
    tokenizer = train_tokenizer(list(texts.values()), spec.vocab)
    streams = {d: token_stream(tokenizer, t) for d, t in texts.items()}  # each [N_d]
    timings["data_s"] = time.perf_counter() - clock
    sizes = {k: getattr(spec, k) for k in ("hidden", "layers", "heads", "kv_heads", "vocab")}
    config = model_config(spec.family, intermediate=spec.intermediate, **sizes)
    # (label, streams, steps, lr, seed, branch from): the base first, then one expert per domain
    runs = [("base", list(streams.values()), spec.base_steps, spec.lr, spec.seed, None)]
    runs += [
        (d, [streams[d]], spec.expert_steps, spec.expert_lr, spec.seed + 1 + i, "base")
        for i, d in enumerate(spec.domains)
    ]
    models = {}
    with progress_bars(progress) as task, quiet_transformers():
        for label, data, steps, lr, seed, parent in runs:
            start = time.perf_counter()
            model = copy.deepcopy(models[parent]) if parent else init_model(config, spec.seed)
            if parent and spec.expert_trains == "ffn":
                train_ffns_only(model)
            losses = train_lm(
                model,
                data,
                steps=steps,
                lr=lr,
                seed=seed,
                batch=spec.batch,
                seq_len=spec.seq_len,
                on_step=task(label, steps),
            )
            rel = "base" if parent is None else f"experts/{label}"
            model.save_pretrained(out_dir / rel)
            tokenizer.save_pretrained(out_dir / rel)
            meta["final_loss"][label] = losses[-1]
            if parent:
                meta["experts"][label] = rel
            else:
                models[label] = model  # the experts branch from it
            timings[f"{label}_s"] = time.perf_counter() - start
    timings["total_s"] = time.perf_counter() - clock
    meta["timings"] = {k: round(v, 2) for k, v in timings.items()}
    (out_dir / TOYSET_FILE).write_text(json.dumps(meta, indent=2))  # last: marks it complete
    return ToySet.load(out_dir)


def cached_toy_experts(
    spec: ToySpec = DEMO,
    cache_dir: Path | None = None,
    progress: bool = True,
    rebuild: bool = False,
) -> ToySet:
    """The toy set of `spec`, made on first use and then read from the cache (moemerge.toy.cache:
    an interrupted make never looks complete)."""
    final = entry_path("toy", spec.key(), cache_dir=cache_dir)
    return ToySet.load(cached_entry(final, TOYSET_FILE,
                                    lambda tmp: make_toy_experts(spec, tmp, progress=progress),
                                    rebuild=rebuild))
