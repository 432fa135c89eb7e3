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
      realset.json               spec, held-out perplexity of every model on every domain,
                                 timings (written last: marks the set complete)
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from moemerge.loading import quiet_transformers
from moemerge.toy.corpora import domain_texts
from moemerge.toy.train import token_stream, train_lm, window_loss

DONE_FILE = "realset.json"


@dataclass(frozen=True)
class RealExpertSpec:
    """Everything that determines a set of real experts."""

    base: str = "smollm2"
    domains: tuple[str, ...] = ("code", "prose", "math", "cpp")
    steps: int = 300
    batch: int = 8
    seq_len: int = 128
    lr: float = 2e-4
    train_chars: int = 600_000  # per domain
    eval_chars: int = 60_000  # per domain
    eval_tokens: int = 8192  # scored per domain
    seed: int = 0


def make_real_experts(spec: RealExpertSpec, base: Path, out_dir: Path,
                      on_step=None) -> dict:
    """Train one expert per domain from `base` into `out_dir` (which must not exist); returns
    what realset.json records. `on_step(domain, step, loss)` reports training."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.mkdir(parents=True)
    shutil.copytree(base, out_dir / "base")
    tokenizer = AutoTokenizer.from_pretrained(base)
    texts = {d: domain_texts(d, spec.train_chars, spec.eval_chars, spec.seed)
             for d in spec.domains}
    (out_dir / "data").mkdir()
    for domain, (train, held) in texts.items():
        (out_dir / "data" / f"{domain}.train.txt").write_text(train)
        (out_dir / "data" / f"{domain}.eval.txt").write_text(held)
    streams = {d: (token_stream(tokenizer, t), token_stream(tokenizer, h))
               for d, (t, h) in texts.items()}
    record = {"spec": asdict(spec), "experts": {}, "perplexity": {}, "seconds": {}}

    def score(model) -> dict[str, float]:
        return {d: heldout_perplexity(model, held, spec.seq_len, spec.eval_tokens)
                for d, (_, held) in streams.items()}

    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    record["perplexity"]["base"] = score(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if ".mlp." in n}
    for domain, (train, _) in streams.items():
        start = time.perf_counter()
        with torch.no_grad():  # every expert branches from the base itself
            for name, param in model.named_parameters():
                param.requires_grad_(name in initial)
                if name in initial:
                    param.copy_(initial[name])
        train_lm(model, [train], steps=spec.steps, batch=spec.batch, seq_len=spec.seq_len,
                 lr=spec.lr, seed=spec.seed, weight_decay=0.0,
                 on_step=(lambda step, loss, d=domain: on_step(d, step, loss))
                 if on_step else None)
        record["perplexity"][f"expert:{domain}"] = score(model)
        target = out_dir / "experts" / domain
        with quiet_transformers():  # bf16 as the base; the float32 model trains on
            copy.deepcopy(model).to(torch.bfloat16).save_pretrained(target)
            tokenizer.save_pretrained(target)
        record["experts"][domain] = f"experts/{domain}"
        record["seconds"][domain] = round(time.perf_counter() - start, 1)
    (out_dir / DONE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


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
