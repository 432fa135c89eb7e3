"""Merged experts on the toy domain experts, the CAMEx paper's comparison in miniature.

Every variant is built from the same experts and fine-tuned with the same steps, data, seed and
learning rate (experts frozen): Domain-specific (no mask), TIES-CA and DARE-CA, each without
curvature (routers only: plain SMEAR / Lory soft merging) and with curvature (routers and
curvature trained), and Dynamic-Merg (with curvature). Reported:
held-out perplexity per domain before and after, and the median step time of each variant as a
ratio to the same mask without curvature (CAMEx claims the overhead is negligible; target
≤ 1.10 on CPU). Results: benchmarks/results/camex.{json,md}.

    python benchmarks/bench_camex.py [--preset demo|tiny] [--steps 80] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from stamp import provenance, stamp_line

RESULTS = Path(__file__).parent / "results"
VARIANTS = {  # label: (recipe lines, parts trained)
    "Domain-specific": (["curvature: {kind: none}"], ["routers"]),
    "Domain-specific-CA": (["curvature: {kind: kronecker}"], ["routers", "curvature"]),
    "TIES": (["curvature: {kind: none}", "mask: {kind: ties}"], ["routers"]),
    "TIES-CA": (["curvature: {kind: kronecker}", "mask: {kind: ties}"], ["routers", "curvature"]),
    "DARE": (["curvature: {kind: none}", "mask: {kind: dare, p: 0.1}"], ["routers"]),
    "DARE-CA": (["curvature: {kind: kronecker}", "mask: {kind: dare, p: 0.1}"],
                ["routers", "curvature"]),
    "Dynamic-CA": (["curvature: {kind: kronecker}", "dynamic: true"], ["routers", "curvature"]),
}
BASELINE = {"Domain-specific-CA": "Domain-specific", "TIES-CA": "TIES", "DARE-CA": "DARE"}


def build_variant(ts, lines: list[str], out: Path, segment: int) -> Path:
    from moemerge.api import build

    experts = [f"  - {{model: {p}, name: {d}}}" for d, p in ts.experts.items()]
    text = "\n".join(["kind: moe", "assembly: merged_experts", f"base_model: {ts.base}",
                      "experts:", *experts, f"segment_length: {segment}", *lines]) + "\n"
    (out.parent / f"{out.name}.yaml").write_text(text)
    build(out.parent / f"{out.name}.yaml", out, progress=False)
    return out


def train_variant(ts, model: Path, out: Path, parts: list[str], args) -> dict:
    from moemerge.train.api import finetune
    from moemerge.train.config import make_config

    cfg = make_config(None, {
        "model": str(model), "output": str(out), "train": parts, "steps": args.steps,
        "data": [f"{d}={p}" for d, p in ts.train_text.items()], "seq_len": args.seq_len,
        "batch_size": args.batch_size, "lr": args.lr, "eval_fraction": 0.05, "device": "cpu",
        "seed": 0})
    result = finetune(cfg)
    steps = [r for r in result.records if r["type"] == "train"]
    step_s = statistics.median(r["tokens"] / r["tokens_per_s"] for r in steps[5:])
    ppl = {stage: {d: v["ppl"] for d, v in values.items()}
           for stage, values in (("before", result.before), ("after", result.after))}
    return {"parts": parts, "step_s": step_s, **ppl}


def markdown(result: dict) -> str:
    rows = result["variants"]
    domains = list(next(iter(rows.values()))["after"])
    first = next(iter(rows.values()))["before"]
    lines = [f"# Merged experts (CAMEx) on the {result['preset']} toy experts", "",
             stamp_line(result["provenance"]), "", "Every variant: "
             f"{result['steps']} steps of {result['batch_size']} × {result['seq_len']} tokens, "
             f"lr {result['lr']}, experts frozen; segments of {result['segment']} tokens.", "",
             "Held-out perplexity (lower is better); step time relative to the same mask "
             "without curvature.", "",
             "| variant | trained | " + " | ".join(domains) + " | mean | step time |",
             "|---|---|" + "---:|" * (len(domains) + 2)]
    mean = sum(first.values()) / len(first)
    lines.append("| before training (soft merge, uniform) | – | "
                 + " | ".join(f"{first[d]:.2f}" for d in domains) + f" | {mean:.2f} | |")
    for label, row in rows.items():
        after = [row["after"][d] for d in domains]
        base = BASELINE.get(label)
        ratio = f"{row['step_s'] / rows[base]['step_s']:.2f}×" if base else ""
        lines.append(f"| {label} | {'+'.join(row['parts'])} | "
                     + " | ".join(f"{v:.2f}" for v in after)
                     + f" | {sum(after) / len(after):.2f} | {ratio} |")
    lines += ["", f"Dynamic-CA stores {result['dynamic_saving']:,} fewer parameters than the "
              f"static model ({result['dynamic_saving_fraction']:.1%})."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("demo", "tiny"), default="demo")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--segment", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(2)

    from moemerge.toy import DEMO, TINY, cached_toy_experts

    ts = cached_toy_experts({"tiny": TINY, "demo": DEMO}[args.preset], progress=False)
    variants, sizes = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, (lines, parts)) in enumerate(VARIANTS.items()):
            model = build_variant(ts, lines, Path(tmp) / f"m{i}", args.segment)
            sizes[label] = sum(f.stat().st_size for f in model.glob("*.safetensors"))
            variants[label] = train_variant(ts, model, Path(tmp) / f"t{i}", parts, args)
            print(label, variants[label]["after"], f"{variants[label]['step_s']:.3f} s/step")
    saving = (sizes["Domain-specific-CA"] - sizes["Dynamic-CA"]) // 4  # fp32 parameters
    result = {"provenance": provenance(), "preset": args.preset, "steps": args.steps,
              "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr,
              "segment": args.segment, "variants": variants, "dynamic_saving": saving,
              "dynamic_saving_fraction": saving * 4 / sizes["Domain-specific-CA"]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "camex.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "camex.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
