"""LoRA experts of SmolLM2-135M (issue 43): four PEFT LoRA adapters trained with peft on the
real base, one per domain (code, prose, math, C++; moemerge.toy.real_lora), and what moemerge
makes of them, against the compute-matched dense control.

Rows: the base; each adapter on the base (peft's PeftModel, unmerged, float32); the dense
control (one adapter of the same config trained on all four domains for 4× an adapter's steps:
the same training tokens as the four adapters together); the dense average of the four
base+adapter models (`kind: merge`, `average`, mergekit's `linear`); a token-routed MoE of the
adapters merged into dense experts (`kind: moe`, top-2, shared tensors averaged, routers
calibrated on the adapters' training text); the MoE of LoRA experts (`assembly: lora_experts`:
the base once, the adapters routed per token, top-2, the same calibration). A row whose build
fails (an assembly this checkout does not have yet, a recipe it refuses) is printed and left
out. Every model is scored as benchmarks/quality/run.py scores its rows: test perplexity on the
test part of each domain's held-out text (windows of 129 tokens, a 32-token prompt, the rest
scored through the KV cache), the mean and the geometric mean over domains, the geometric mean
against the control's; for the MoEs the share of each domain's routing that reaches its own
expert. Built outputs: size on disk and `moemerge.api.build` time (in process, its load check
included), one build at a time.

    python benchmarks/quality/lora.py [--max-tokens 2048] [--calibration-tokens 1024]

The set and its control are made on first use and cached (19 + 15 min on 2 cores).
Results: benchmarks/results/lora-smollm2.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]
from models import build_result, calibration  # noqa: E402
from run import Scorer, split_held_out  # noqa: E402
from stamp import provenance, stamp_line  # noqa: E402

RESULTS = Path(__file__).parent.parent / "results"
NAME = "lora-smollm2"
# the rows in the table's order: (key, label); keys starting "token_" get the routing share
LABELS = {
    "base": "base",
    "control": "dense control: base + one adapter on all 4 domains",
    "merge": "dense average of the 4 base+adapter models",
    "token_moe": "token_routed MoE of the adapters merged into dense experts",
    "token_moe_auto": "the same, experts_per_token: auto, confidence: fit",
    "token_lora_experts": "lora_experts MoE (the base once, the adapters routed)",
    "token_lora_experts_fit": "the same, confidence: fit",
}
# rows left out, not failing the run, when their build (or routing report) fails: the
# assembly is newer than the others
OPTIONAL = {"token_lora_experts", "token_lora_experts_fit", "token_moe_auto"}


def recipes(ls, k: int, tokens: int) -> dict[str, list[str]]:
    """{key: recipe lines} of the rows built from the LoRA set `ls`."""
    experts = ["experts:"] + [f"  - {{model: {ls.base}, lora: {a}, name: {d}}}"
                              for d, a in ls.adapters.items()]
    models = ", ".join(f"{{model: {ls.base}, lora: {a}}}" for a in ls.adapters.values())
    routed = [f"experts_per_token: {k}", *experts, "router: {init: calibrate}",
              calibration(ls, 128, tokens)]
    fitted = calibration(ls, 128, tokens).replace("}", ", confidence: fit}")
    return {
        "merge": ["kind: merge", "seed: 0", f"base_model: {ls.base}", f"models: [{models}]",
                  "merge: {method: average}"],
        "token_moe": ["kind: moe", "seed: 0", f"base_model: {ls.base}",
                      "merge: {method: average}", *routed],
        "token_moe_auto": ["kind: moe", "seed: 0", f"base_model: {ls.base}",
                           "merge: {method: average}", "experts_per_token: auto", *experts,
                           "router: {init: calibrate}", fitted],
        "token_lora_experts": ["kind: moe", "assembly: lora_experts", "seed: 0",
                               f"base_model: {ls.base}", *routed],
        "token_lora_experts_fit": ["kind: moe", "assembly: lora_experts", "seed: 0",
                                   f"base_model: {ls.base}", *routed[:-1], fitted],
    }


def size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def with_adapter(base: Path, adapter: Path):
    """(PeftModel of `adapter` on `base` in float32, unmerged; the base's tokenizer)."""
    from peft import PeftModel

    from moemerge.loading import load_causal_lm

    model, tokenizer = load_causal_lm(base)
    return PeftModel.from_pretrained(model, adapter).eval(), tokenizer


def geo_mean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=2048, help="test tokens per domain")
    parser.add_argument("--calibration-tokens", type=int, default=1024,
                        help="calibration tokens per domain for the MoEs' routers")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--experts-per-token", type=int, default=2)
    parser.add_argument("--skip", default="", help="comma-separated row keys left out")
    args = parser.parse_args()
    args.exact_match = 0
    clock = time.perf_counter()

    import torch

    from moemerge.modeling import register
    from moemerge.toy.real_lora import (
        CONTROL_FILE,
        LORA,
        cached_lora_control,
        cached_lora_experts,
    )

    torch.set_num_threads(min(torch.get_num_threads(), 2))
    register()
    ls = cached_lora_experts(LORA)
    control = cached_lora_control(ls)
    control_record = json.loads((control / CONTROL_FILE).read_text())
    score = Scorer({d: split_held_out(p.read_text())[1] for d, p in ls.eval_text.items()}, args)
    skip = set(filter(None, args.skip.split(",")))
    base_size = size_bytes(ls.base)
    rows: list[dict] = []
    skipped: dict[str, str] = {}

    def add(key: str, label: str, ref, **extra) -> None:
        try:
            perplexity, own = score(key, ref)[:2]
        except Exception as exc:
            if key not in OPTIONAL:
                raise
            print(f"{label}: no routing report ({type(exc).__name__}: {exc}); perplexity "
                  "only", flush=True)
            perplexity, own = score("plain", ref)[:2]
        row = {"key": key, "model": label, "perplexity": perplexity,
               "mean": sum(perplexity.values()) / len(perplexity),
               "geo_mean": geo_mean(perplexity.values()), "own_share": own, **extra}
        rows.append(row)
        print(f"{label}: " + ", ".join(f"{d} {v:.2f}" for d, v in perplexity.items())
              + f" (mean {row['mean']:.3f}, geo {row['geo_mean']:.3f})", flush=True)

    add("base", LABELS["base"], ls.base, size=base_size)
    for d, adapter in ls.adapters.items():
        add(f"adapter:{d}", f"base + {d} adapter", with_adapter(ls.base, adapter),
            size=base_size, adapter_size=size_bytes(adapter))
        gc.collect()
    own = {d: next(r for r in rows if r["key"] == f"adapter:{d}")["perplexity"][d]
           for d in ls.adapters}  # the oracle: each domain's text through its own adapter
    rows.append({"key": "oracle", "model": "oracle: each domain through its own adapter",
                 "perplexity": own, "mean": sum(own.values()) / len(own),
                 "geo_mean": geo_mean(own.values()), "own_share": None, "size": base_size})
    add("control", LABELS["control"], with_adapter(ls.base, control / "adapter"),
        size=base_size, adapter_size=size_bytes(control / "adapter"))
    gc.collect()
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        work = Path(tmp)
        for key, lines in recipes(ls, args.experts_per_token, args.calibration_tokens).items():
            if key in skip:
                continue
            out = work / key
            start = time.perf_counter()
            try:
                build_result(lines, out)
            except Exception as exc:  # an assembly this checkout lacks, a recipe it refuses
                if key not in OPTIONAL:
                    raise
                skipped[key] = f"{type(exc).__name__}: {exc}"
                print(f"{LABELS[key]}: build failed, row left out:\n"
                      + "".join(traceback.format_exception_only(exc)), flush=True)
                continue
            seconds = time.perf_counter() - start
            config = json.loads((out / "config.json").read_text())
            k = config.get("num_experts_per_tok", config.get("experts_per_token"))
            add(key, LABELS[key], out, size=size_bytes(out), build_s=round(seconds, 1),
                recipe=lines, experts_per_token=k)
            gc.collect()
    by_key = {r["key"]: r for r in rows}
    for r in rows:
        r["vs_control_pct"] = 100 * (r["geo_mean"] / by_key["control"]["geo_mean"] - 1)
        r["vs_oracle_pct"] = 100 * (r["geo_mean"] / by_key["oracle"]["geo_mean"] - 1)
    spec = ls.spec
    result = {
        "provenance": provenance(), "set": str(ls.root), "spec": ls.record["spec"],
        "peft": ls.record["peft"], "test_tokens": args.max_tokens,
        "calibration_tokens": args.calibration_tokens, "prompt_tokens": args.prompt_tokens,
        "experts_per_token": args.experts_per_token,
        "training": {"adapter_steps": spec.steps, "adapter_tokens": spec.tokens(),
                     "adapters_tokens": len(ls.adapters) * spec.tokens(),
                     "adapter_seconds": {d: ls.record["seconds"][d] for d in ls.adapters},
                     "trainable_parameters": ls.record["trainable_parameters"],
                     "control_steps": control_record["steps"],
                     "control_tokens": control_record["tokens"],
                     "control_seconds": control_record["seconds"]},
        "set_perplexity": ls.record["perplexity"] | {"control": control_record["perplexity"]},
        "runtime_s": round(time.perf_counter() - clock), "rows": rows, "skipped": skipped,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{NAME}.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / f"{NAME}.md").write_text(markdown(result, args))
    print(markdown(result, args))


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def markdown(result: dict, args) -> str:
    rows, t = result["rows"], result["training"]
    domains = list(rows[0]["perplexity"])
    head = ("| model | " + " | ".join(domains) + " | mean | geo mean | vs oracle | vs control | "
            "on disk (MiB) | build s | own-expert share |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        p = r["perplexity"]
        size = (f"{mib(r['size'])} + {mib(r['adapter_size'])}" if "adapter_size" in r
                else mib(r["size"]) if r["key"] != "oracle" else "–")
        own = (", ".join(f"{d} {v:.2f}" for d, v in r["own_share"].items())
               if r.get("own_share") else "–")
        lines.append(f"| {r['model']} | " + " | ".join(f"{p[d]:.2f}" for d in domains)
                     + f" | {r['mean']:.3f} | {r['geo_mean']:.3f} | "
                     f"{r['vs_oracle_pct']:+.1f} % | {r['vs_control_pct']:+.1f} % | {size} | "
                     + (f"{r['build_s']:.1f}" if "build_s" in r else "–") + f" | {own} |")
    spec = result["spec"]
    seconds = ", ".join(f"{d} {s:.0f} s" for d, s in t["adapter_seconds"].items())
    skipped = "".join(f"\n\nLeft out (its build failed): `{key}`: {why.splitlines()[0]}"
                      for key, why in result["skipped"].items())
    command = (f"python benchmarks/quality/lora.py --max-tokens {args.max_tokens} "
               f"--calibration-tokens {args.calibration_tokens}")
    return (
        f"# LoRA experts of SmolLM2-135M: adapters, their merges and MoEs, against the "
        f"compute-matched control\n\n{stamp_line(result['provenance'])}\n\n`{command}` "
        f"({result['runtime_s']} s)\n\n"
        f"Experts: peft {result['peft']} LoRA adapters (r {spec['r']}, alpha {spec['alpha']}, "
        f"{', '.join(spec['target_modules'])}; {t['trainable_parameters']:,} trained "
        f"parameters) on the SmolLM2-135M-Instruct base, one per domain, each trained "
        f"{t['adapter_steps']} steps of {spec['batch']} × {spec['seq_len']} tokens "
        f"({t['adapter_tokens']:,} tokens; lr {spec['lr']}, float32; {seconds} on this "
        f"machine), {t['adapters_tokens']:,} tokens in all. Control: one adapter of the same "
        f"config trained the same way on all four domains for {t['control_steps']} steps "
        f"({t['control_tokens']:,} tokens, {t['control_seconds']:.0f} s). Adapter rows run "
        "peft's PeftModel (unmerged, float32); built rows are bf16 checkpoints (the base's "
        "dtype) loaded in float32.\n\n"
        f"Test perplexity per domain ({result['test_tokens']} test tokens per domain, "
        f"{result['prompt_tokens']}-token prompt, as benchmarks/quality/run.py scores), its "
        "mean and geometric mean; vs oracle / vs control: the geometric mean against the "
        "oracle's (each domain through its own adapter) / the control's. "
        "On disk: the checkpoint directory (adapter rows: the base + the adapter). Build s: "
        "`moemerge.api.build` in process, its load check included. MoE routers: "
        f"`router.init: calibrate` on the adapters' training text, "
        f"{result['calibration_tokens']} tokens per domain; top-"
        f"{result['experts_per_token']}. Own-expert share: the share of each domain's tokens "
        f"whose top-{result['experts_per_token']} holds its own expert (rows with "
        "`experts_per_token: auto`: its chosen k; `confidence: fit`: each router's scale fitted "
        "on held-out calibration windows, docs/routing.md)."
        f"{skipped}\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
