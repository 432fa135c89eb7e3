"""LoRA experts of a real pretrained base: one PEFT LoRA adapter per domain, trained with peft's
own `LoraConfig` / `get_peft_model` on the FFNs only (gate / up / down projections, the modules
the full experts of moemerge.toy.real_experts train), on the same text, by the same loop
(moemerge.toy.train.train_lm, float32, the base frozen).

    out_dir/
      base/                      the converted base (moemerge.toy.pretrained)
      adapters/<domain>/         adapter_config.json, adapter_model.safetensors (float32):
                                 `save_pretrained`'s files, loadable with
                                 `PeftModel.from_pretrained(base, dir)` and readable by any
                                 recipe as `{model: base, lora: dir}`
      data/<domain>.train.txt    the text each adapter trained on
      data/<domain>.eval.txt     held-out text from documents disjoint from training
      loraset.json               spec, paths, held-out perplexity of the base and of each
                                 adapter (PeftModel forward) on every domain, timings, trained
                                 parameters and tokens (written last: marks the set complete);
                                 `LoraSet.load(dir)` reads it

On 2 cores (SmolLM2-135M, float32, 8 × 128 tokens a step) a LoRA step costs what a full FFN
step does, 5-6 s (measured 2026-11-28: 185-200 tokens/s either way in one probe; the backward
through the frozen layers dominates), so an adapter gets 40 steps (41k tokens; 214-240 s each
when LORA was made, plus ~45 s scoring it), a third of a full expert's tokens, at a LoRA
learning rate of 2e-3.

Each adapter's `base_model_name_or_path` is left empty: the set's base is base/ (a GGUF
dequantised, not the hub's weights), wherever the set is copied to.

`cached_lora_experts` keeps one set per (spec, base) under $MOEMERGE_CACHE;
`cached_lora_control` the compute-matched dense control beside it (one adapter of the same
config trained on every domain for as many steps as all the adapters together).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from moemerge.errors import RecipeError
from moemerge.toy.cache import cached_entry, entry_path
from moemerge.toy.experts import progress_bars
from moemerge.toy.real_experts import domain_scores, load_float32, start_set
from moemerge.toy.train import token_stream, train_lm

FORMAT_VERSION = 1  # bump when the corpora or the training change what a spec makes
LORASET_FILE = "loraset.json"
CONTROL_FILE = "lora-mixture.json"


@dataclass(frozen=True)
class LoraExpertSpec:
    """Everything that determines a set of LoRA experts; `key()` names its cache entry."""

    base: str = "smollm2"
    domains: tuple[str, ...] = ("code", "prose", "math", "cpp")
    r: int = 16
    alpha: int = 32
    target_modules: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    # 40 steps of 8 × 128 tokens (41k tokens, ~4 min an adapter on 2 cores)
    steps: int = 40
    batch: int = 8
    seq_len: int = 128
    lr: float = 2e-3
    train_chars: int = 600_000  # per domain, as the full experts'
    eval_chars: int = 60_000  # per domain
    eval_tokens: int = 4096  # scored per domain for loraset.json's table
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps({"format": FORMAT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def tokens(self, steps: int | None = None) -> int:
        """Training tokens of `steps` steps (default: one adapter's)."""
        return (self.steps if steps is None else steps) * self.batch * self.seq_len


LORA = LoraExpertSpec()


@dataclass
class LoraSet:
    """A made LoRA set; paths are absolute, loraset.json stores them relative to `root`."""

    root: Path
    base: Path
    adapters: dict[str, Path]
    train_text: dict[str, Path]
    eval_text: dict[str, Path]
    spec: LoraExpertSpec
    record: dict

    @classmethod
    def load(cls, root: Path) -> LoraSet:
        record = json.loads((root / LORASET_FILE).read_text())
        spec = LoraExpertSpec(**{**record["spec"], "domains": tuple(record["spec"]["domains"]),
                                 "target_modules": tuple(record["spec"]["target_modules"])})
        paths = {k: {d: root / p for d, p in record[k].items()}
                 for k in ("adapters", "train_text", "eval_text")}
        return cls(root=root, base=root / record["base"], spec=spec, record=record, **paths)


def require_peft() -> None:
    """A RecipeError saying how to get peft, which trains the adapters, where it is missing."""
    if importlib.util.find_spec("peft") is None:
        raise RecipeError("the LoRA experts are trained with peft, which is not installed: "
                          "pip install peft")


def lora_config(spec: LoraExpertSpec):
    """peft's LoraConfig of `spec`'s adapters."""
    from peft import LoraConfig

    return LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.target_modules),
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")


def train_adapter(base: Path, streams: list, steps: int, spec: LoraExpertSpec, on_step=None):
    """A LoRA of `spec`'s config on `base` (loaded in float32, frozen; A initialised from
    `spec.seed`), trained `steps` steps on `streams` (a batch's rows go round them: equal
    shares of each): the PeftModel, in eval mode."""
    import torch
    from peft import get_peft_model

    model = load_float32(base)
    with torch.random.fork_rng(devices=[]):  # the caller's global RNG left untouched
        torch.manual_seed(spec.seed)
        model = get_peft_model(model, lora_config(spec))
    train_lm(model, streams, steps=steps, batch=spec.batch, seq_len=spec.seq_len, lr=spec.lr,
             seed=spec.seed, weight_decay=0.0, on_step=on_step)
    return model


def save_adapter(model, target: Path) -> None:
    """`save_pretrained`'s adapter files, naming no base (see the module docstring; peft
    names the path the base was loaded from, in adapter_config.json and its README.md)."""
    for config in model.peft_config.values():
        config.base_model_name_or_path = None
    base = model.get_base_model()
    base.name_or_path = base.config.name_or_path = ""  # what save_pretrained fills them from
    model.save_pretrained(target)


def make_lora_experts(spec: LoraExpertSpec, base: Path, out_dir: Path,
                      progress: bool = False) -> dict:
    """Train one LoRA adapter per domain on `base` into `out_dir` (which must not exist);
    returns what loraset.json records."""
    require_peft()
    import peft

    clock = time.perf_counter()
    record = {"format": FORMAT_VERSION, "spec": asdict(spec), "peft": peft.__version__,
              "base": "base", "adapters": {}, "train_text": {}, "eval_text": {},
              "perplexity": {}, "seconds": {}, "tokens_per_adapter": spec.tokens()}
    _, streams = start_set(spec, base, out_dir, record)
    start = time.perf_counter()
    record["perplexity"]["base"] = domain_scores(load_float32(base), streams, spec)
    record["seconds"]["score:base"] = round(time.perf_counter() - start, 1)
    with progress_bars(progress) as task:
        for domain, (train, _) in streams.items():
            start = time.perf_counter()
            model = train_adapter(base, [train], spec.steps, spec, task(domain, spec.steps))
            record["seconds"][domain] = round(time.perf_counter() - start, 1)
            save_adapter(model, out_dir / "adapters" / domain)
            record["adapters"][domain] = f"adapters/{domain}"
            record["trainable_parameters"] = sum(p.numel() for p in model.parameters()
                                                 if p.requires_grad)
            start = time.perf_counter()
            record["perplexity"][f"adapter:{domain}"] = domain_scores(model, streams, spec)
            record["seconds"][f"score:{domain}"] = round(time.perf_counter() - start, 1)
    record["seconds"]["total"] = round(time.perf_counter() - clock, 1)
    (out_dir / LORASET_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def make_lora_control(loraset: LoraSet, out_dir: Path, progress: bool = False) -> dict:
    """The dense control of a LoRA set: one adapter of the same config, trained by
    `train_adapter` on every domain at once for as many steps as all the set's adapters
    together (the same training tokens); written to `out_dir`/adapter with lora-mixture.json
    (its steps, tokens, held-out perplexity on each domain as loraset.json scores it, timing;
    written last)."""
    from transformers import AutoTokenizer

    spec, start = loraset.spec, time.perf_counter()
    steps = len(spec.domains) * spec.steps
    tokenizer = AutoTokenizer.from_pretrained(loraset.base)
    streams = {d: tuple(token_stream(tokenizer, p.read_text(encoding="utf-8"))
                        for p in (loraset.train_text[d], loraset.eval_text[d]))
               for d in spec.domains}
    out_dir.mkdir(parents=True)
    with progress_bars(progress) as task:
        model = train_adapter(loraset.base, [train for train, _ in streams.values()], steps,
                              spec, task("all domains", steps))
    seconds = round(time.perf_counter() - start, 1)
    save_adapter(model, out_dir / "adapter")
    record = {"steps": steps, "tokens": spec.tokens(steps), "seconds": seconds,
              "perplexity": domain_scores(model, streams, spec)}
    (out_dir / CONTROL_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def cached_lora_experts(spec: LoraExpertSpec = LORA, cache_dir: Path | None = None,
                        progress: bool = True) -> LoraSet:
    """The LoRA set of `spec`, made on first use (19 min on 2 cores for LORA; its control,
    `cached_lora_control`, 15 min more) and then read from the cache; its base is
    `cached_pretrained(spec.base)`."""
    from moemerge.toy.pretrained import cached_pretrained

    require_peft()
    base = cached_pretrained(spec.base, cache_dir)
    final = entry_path("real-lora", f"{base.name}-{spec.key()}", cache_dir=cache_dir)
    entry = cached_entry(final, LORASET_FILE,
                         lambda tmp: make_lora_experts(spec, base, tmp, progress=progress))
    return LoraSet.load(entry)


def cached_lora_control(loraset: LoraSet, progress: bool = True) -> Path:
    """`make_lora_control` of a cached LoRA set, cached beside it: the directory holding
    adapter/ and lora-mixture.json."""
    final = loraset.root.with_name(f"{loraset.root.name}-mixture")
    return cached_entry(final, CONTROL_FILE,
                        lambda tmp: make_lora_control(loraset, tmp, progress=progress))
