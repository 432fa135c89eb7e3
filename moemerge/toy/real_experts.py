"""Domain experts branched from a real pretrained base (Branch-Train-Mix at real scale), made
offline from text every machine has.

Each expert is the base with its FFNs trained further on one domain, everything else frozen:
BTX's experts differ where the MoE keeps them apart, and FFN-only steps are what 2 cores
afford (SmolLM2-135M, 8 × 128 tokens a step, float32: 237 tokens/s; with bf16 autocast 68, the
casts of 30 layers' weights every step costing more than AMX saves at this size).

    out_dir/
      base/                      the converted base (moemerge.toy.pretrained)
      experts/<domain>/          bf16, the base's tokenizer and config
      data/<domain>.train.txt    the text each expert trained on
      data/<domain>.eval.txt     held-out text from documents disjoint from training
      realset.json               spec, paths, held-out perplexity of every model on every
                                 domain, timings (written last: marks the set complete);
                                 `ToySet.load(dir, REALSET_FILE, RealExpertSpec)` reads it

`cached_real_experts` keeps one set per (spec, base) under $MOEMERGE_CACHE.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from moemerge.loading import quiet_transformers
from moemerge.toy.cache import cached_entry, entry_path
from moemerge.toy.experts import ToySet, progress_bars, write_texts
from moemerge.toy.train import token_stream, train_lm, window_loss

FORMAT_VERSION = 1  # bump when the corpora or the training change what a spec makes
REALSET_FILE = "realset.json"
MIXTURE_FILE = "mixture.json"


@dataclass(frozen=True)
class RealExpertSpec:
    """Everything that determines a set of real experts; `key()` names its cache entry."""

    base: str = "smollm2"
    domains: tuple[str, ...] = ("code", "prose", "math", "cpp")
    # 120 steps of 8 × 128 tokens (123k tokens, ~8 min an expert on 2 cores)
    steps: int = 120
    batch: int = 8
    seq_len: int = 128
    lr: float = 3e-4
    train_chars: int = 600_000  # per domain
    eval_chars: int = 60_000  # per domain
    eval_tokens: int = 4096  # scored per domain for realset.json's table
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps({"format": FORMAT_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


REAL = RealExpertSpec()
# the bridged benchmark's Gemma expert (benchmarks/quality/bridged.py): Gemma 3 270M's FFNs on
# the same math text as REAL's math expert; 60 steps, as a Gemma step (its 262144-row head)
# costs about twice a SmolLM2 step on 2 cores
GEMMA3_MATH = RealExpertSpec(base="gemma3", domains=("math",), steps=60)


def make_real_experts(spec: RealExpertSpec, base: Path, out_dir: Path,
                      progress: bool = False) -> dict:
    """Train one expert per domain from `base` into `out_dir` (which must not exist); returns
    what realset.json records."""
    clock = time.perf_counter()
    record = {"format": FORMAT_VERSION, "spec": asdict(spec), "base": "base", "experts": {},
              "train_text": {}, "eval_text": {}, "perplexity": {}, "seconds": {}}
    tokenizer, streams = start_set(spec, base, out_dir, record)

    def score(model) -> dict[str, float]:
        return domain_scores(model, streams, spec)

    model = load_float32(base)
    record["perplexity"]["base"] = score(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if ".mlp." in n}
    with progress_bars(progress) as task:
        for domain, (train, _) in streams.items():
            start = time.perf_counter()
            _train_ffns(model, initial, [train], spec.steps, spec, task(domain, spec.steps))
            record["perplexity"][f"expert:{domain}"] = score(model)
            _save_bf16(model, tokenizer, out_dir / "experts" / domain)
            record["experts"][domain] = f"experts/{domain}"
            record["seconds"][domain] = round(time.perf_counter() - start, 1)
    record["seconds"]["total"] = round(time.perf_counter() - clock, 1)
    (out_dir / REALSET_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def start_set(spec, base: Path, out_dir: Path, record: dict) -> tuple:
    """The start of a set branched from a real `base` (this module's experts, and the LoRA
    experts of moemerge.toy.real_lora): `out_dir` made (it must not exist) with a copy of the
    base in base/ and each domain's text in data/ (their paths recorded in `record`'s
    train_text / eval_text); returns (the base's tokenizer, {domain: (train, held-out) token
    streams})."""
    from transformers import AutoTokenizer

    out_dir.mkdir(parents=True)
    shutil.copytree(base, out_dir / "base")
    tokenizer = AutoTokenizer.from_pretrained(base)
    streams = {d: (token_stream(tokenizer, train), token_stream(tokenizer, held))
               for d, (train, held) in write_texts(spec, out_dir, record).items()}
    return tokenizer, streams


def domain_scores(model, streams: dict, spec) -> dict[str, float]:
    """{domain: held-out perplexity} of `model` on each domain's held-out stream of `streams`
    ({domain: (train, held-out)}), `spec.eval_tokens` tokens in windows of `spec.seq_len`."""
    return {d: round(heldout_perplexity(model, held, spec.seq_len, spec.eval_tokens), 4)
            for d, (_, held) in streams.items()}


def load_float32(path: Path):
    """The causal LM at `path` in float32 (the precision the experts train in)."""
    import torch
    from transformers import AutoModelForCausalLM

    with quiet_transformers():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _train_ffns(model, initial: dict, streams: list, steps: int, spec: RealExpertSpec,
                on_step) -> None:
    """Reset the FFNs to `initial` (the base's: every model branches from the base itself),
    freeze everything else, and train the FFNs `steps` steps on `streams` (a batch's rows go
    round the streams: equal shares of each)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            param.requires_grad_(name in initial)
            if name in initial:
                param.copy_(initial[name])
    train_lm(model, streams, steps=steps, batch=spec.batch, seq_len=spec.seq_len, lr=spec.lr,
             seed=spec.seed, weight_decay=0.0, on_step=on_step)


def _save_bf16(model, tokenizer, target: Path) -> None:
    import torch

    with quiet_transformers():  # bf16 as the base; the float32 model trains on
        copy.deepcopy(model).to(torch.bfloat16).save_pretrained(target)
        tokenizer.save_pretrained(target)


def make_mixture_control(toyset: ToySet, out_dir: Path, extra_steps: int = 0,
                         progress: bool = False) -> dict:
    """Branch-Train-Mix's dense control: the base's FFNs trained on every domain at once, as
    the experts were trained (same lr, batches, schedule, frozen rest) for as many steps as all
    the experts together, plus `extra_steps` (those an MoE trains after the merge); written to
    `out_dir` in bf16 with mixture.json (written last)."""
    from transformers import AutoTokenizer

    spec, start = toyset.spec, time.perf_counter()
    steps = len(spec.domains) * spec.steps + extra_steps
    tokenizer = AutoTokenizer.from_pretrained(toyset.base)
    streams = [token_stream(tokenizer, p.read_text(encoding="utf-8"))
               for p in toyset.train_text.values()]
    model = load_float32(toyset.base)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if ".mlp." in n}
    with progress_bars(progress) as task:
        _train_ffns(model, initial, streams, steps, spec, task("all domains", steps))
    _save_bf16(model, tokenizer, out_dir)
    record = {"steps": steps, "seconds": round(time.perf_counter() - start, 1)}
    (out_dir / MIXTURE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def cached_mixture_control(toyset: ToySet, extra_steps: int = 0,
                           progress: bool = True) -> Path:
    """`make_mixture_control` of a cached real set, cached beside it."""
    final = toyset.root.with_name(f"{toyset.root.name}-mixture-{extra_steps}")
    return cached_entry(final, MIXTURE_FILE, lambda tmp: make_mixture_control(
        toyset, tmp, extra_steps, progress=progress))


def cached_real_experts(spec: RealExpertSpec = REAL, cache_dir: Path | None = None,
                        progress: bool = True) -> ToySet:
    """The real expert set of `spec`, made on first use (about 35 min on 2 cores for REAL) and
    then read from the cache; its base is `cached_pretrained(spec.base)`."""
    from moemerge.toy.pretrained import cached_pretrained

    base = cached_pretrained(spec.base, cache_dir)
    final = entry_path("real", f"{base.name}-{spec.key()}", cache_dir=cache_dir)
    entry = cached_entry(final, REALSET_FILE,
                         lambda tmp: make_real_experts(spec, base, tmp, progress=progress))
    return ToySet.load(entry, REALSET_FILE, RealExpertSpec)


def heldout_perplexity(model, stream, seq_len: int, max_tokens: int) -> float:
    """exp(mean next-token loss) over consecutive non-overlapping windows of `seq_len` scored
    tokens from the start of `stream` [N], at most `max_tokens` of them."""
    import torch

    count = min(len(stream) - 1, max_tokens) // seq_len
    windows = torch.stack([stream[i * seq_len: (i + 1) * seq_len + 1] for i in range(count)])
    model.eval()
    with torch.no_grad():
        losses = [float(window_loss(model, windows[i: i + 8])) * len(windows[i: i + 8])
                  for i in range(0, count, 8)]
    return math.exp(sum(losses) / count)
