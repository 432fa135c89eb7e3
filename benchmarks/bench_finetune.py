"""Finetune throughput and memory: `--router-only` against `--full` on the same MoE, and
`--router-only --gradient-checkpointing`, one run.

Builds (or reuses) the toy MoE (TINY or DEMO experts, random routers) and runs `moemerge
finetune` once per mode, each in a fresh process so that its peak RSS (ru_maxrss) is its own.
Tokens/s is the median over the training steps after the first 5 (warm-up excluded), read from
OUT/training/metrics.jsonl. Target: router-only ≥ 1.3× full; gradient checkpointing lowers
the peak. Results: benchmarks/results/finetune[-SHAPE].{json,md}.

    python benchmarks/bench_finetune.py [--preset tiny|demo] [--steps 40] [--seq-len 128]
    python benchmarks/bench_finetune.py --shape llama-3.2-1b --layers 4 --steps 3 \
        --seq-len 512 --batch-size 1 --modes router-only,checkpointed

--shape: a token-routed MoE of 2 experts (random, perturbed copies of one base) with the
published config of that model, every tensor at its real size, `--layers` of its layers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from stamp import provenance, stamp_line

RESULTS = Path(__file__).parent / "results"
CHILD = """
import resource, sys
from moemerge.cli import app
try:
    app(sys.argv[1:], standalone_mode=False)
finally:
    print("MAXRSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


def make_moe(preset: str, work: Path) -> tuple[Path, dict[str, Path]]:
    from moemerge.api import build
    from moemerge.toy import DEMO, TINY, cached_toy_experts

    ts = cached_toy_experts({"tiny": TINY, "demo": DEMO}[preset], progress=False)
    lines = ["kind: moe", f"base_model: {ts.base}", "experts:"]
    lines += [f"  - {{model: {p}, name: {d}}}" for d, p in ts.experts.items()]
    lines += ["experts_per_token: 2", "merge: {method: average}", "router: {init: random}"]
    (work / "recipe.yaml").write_text("\n".join(lines) + "\n")
    build(work / "recipe.yaml", work / "moe", progress=False)
    return work / "moe", ts.train_text


def make_shaped_moe(shape: str, layers: int, work: Path) -> tuple[Path, dict[str, Path]]:
    """A token-routed MoE at a published model's real tensor sizes (`layers` of its layers)."""
    import torch
    from safetensors.torch import load_file, save_file

    from moemerge.api import build
    from moemerge.toy import TINY, cached_toy_experts
    from moemerge.toy.published import published_model

    base = published_model(shape, work / "base", num_hidden_layers=layers)
    experts = []
    for e in range(2):
        (work / f"e{e}").mkdir()
        for f in base.iterdir():
            if f.suffix != ".safetensors":
                (work / f"e{e}" / f.name).write_bytes(f.read_bytes())
        gen = torch.Generator().manual_seed(e)
        tensors = {n: (t.float() + 1e-3 * torch.randn(t.shape, generator=gen)).to(t.dtype)
                   for n, t in load_file(base / "model.safetensors").items()}
        save_file(tensors, work / f"e{e}" / "model.safetensors", metadata={"format": "pt"})
        experts.append(work / f"e{e}")
    # the toy tokenizer (vocab 512) stands in: its ids are valid in any larger vocabulary
    ts = cached_toy_experts(TINY, progress=False)
    for e in [base, *experts]:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (e / f).write_bytes((ts.base / f).read_bytes())
    (work / "recipe.yaml").write_text(
        f"kind: moe\nbase_model: {base}\nexperts: [{experts[0]}, {experts[1]}]\n"
        "experts_per_token: 2\nrouter: {init: random}\noutput: {dtype: float32}\n")
    build(work / "recipe.yaml", work / "moe", progress=False)
    return work / "moe", ts.train_text


MODES = {"router-only": ["--router-only"], "full": ["--full"],
         "checkpointed": ["--router-only", "--gradient-checkpointing"]}


def run_mode(mode: str, moe: Path, data: dict[str, Path], out: Path, args) -> dict:
    cmd = [sys.executable, "-c", CHILD, "finetune", str(moe), str(out), *MODES[mode], "-q",
           "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--batch-size",
           str(args.batch_size), "--eval-fraction", "0.02", "--device", "cpu"]
    cmd += sum((["--data", f"{d}={p}"] for d, p in data.items()), [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{mode} failed:\n{done.stderr[-3000:]}")
    rss = int(done.stderr.rsplit("MAXRSS_KB", 1)[1].split()[0]) * 1024
    records = [json.loads(x) for x in (out / "training/metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in records if r["type"] == "train"]
    tps = tps[5:] or tps[1:] or tps  # warm-up excluded when there are steps to spare
    return {"mode": " ".join(MODES[mode]), "tokens_per_s": statistics.median(tps),
            "peak_rss_bytes": rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=["tiny", "demo"], default="demo")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--shape", help="a published config (moemerge/toy/published_configs.json)")
    parser.add_argument("--layers", type=int, default=4, help="with --shape: layers kept")
    parser.add_argument("--modes", default="router-only,full,checkpointed")
    args = parser.parse_args()
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        moe, data = (make_shaped_moe(args.shape, args.layers, work) if args.shape
                     else make_moe(args.preset, work))
        runs = {m: run_mode(m, moe, data, work / m, args) for m in modes}
    model = (f"{args.shape} shape, {args.layers} layers, 2 experts" if args.shape
             else f"{args.preset} MoE")
    result = {"provenance": provenance(), "model": model, "steps": args.steps,
              "seq_len": args.seq_len, "batch_size": args.batch_size, "runs": list(runs.values())}
    lines = []
    if {"router-only", "full"} <= runs.keys():
        ratio = runs["router-only"]["tokens_per_s"] / runs["full"]["tokens_per_s"]
        result["router_only_over_full"] = ratio
        lines.append(f"router-only / full tokens/s: **{ratio:.2f}×** (target ≥ 1.3×)")
    if {"router-only", "checkpointed"} <= runs.keys():
        peak = runs["checkpointed"]["peak_rss_bytes"] / runs["router-only"]["peak_rss_bytes"]
        speed = runs["checkpointed"]["tokens_per_s"] / runs["router-only"]["tokens_per_s"]
        result |= {"checkpointed_peak_ratio": peak, "checkpointed_speed_ratio": speed}
        lines.append(f"gradient checkpointing: peak RSS **{peak:.2f}×**, tokens/s {speed:.2f}× "
                     "of router-only without it")
    name = f"finetune-{args.shape}" if args.shape else "finetune"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = "\n".join(f"| `{r['mode']}` | {r['tokens_per_s']:,.0f} | "
                     f"{r['peak_rss_bytes'] / 2**20:,.0f} |" for r in runs.values())
    (RESULTS / f"{name}.md").write_text(
        f"# finetune: router-only, full and checkpointed ({model}, CPU)\n\n"
        f"{stamp_line(result['provenance'])}\n\n"
        f"{args.steps} steps, batch {args.batch_size} × {args.seq_len} tokens, one process.\n\n"
        f"| mode | tokens/s (median) | peak RSS (MiB) |\n|---|---:|---:|\n{rows}\n\n"
        + "\n\n".join(lines) + "\n")
    print((RESULTS / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
