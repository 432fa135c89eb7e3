"""Finetune throughput and memory: `--router-only` against `--full` on the same MoE, one run.

Builds (or reuses) the toy MoE (TINY or DEMO experts, random routers) and runs `moemerge
finetune` once per mode, each in a fresh process so that its peak RSS (ru_maxrss) is its own.
Tokens/s is the median over the training steps after the first 5 (warm-up excluded), read from
OUT/training/metrics.jsonl. Target: router-only ≥ 1.3× full. Results:
benchmarks/results/finetune.{json,md}.

    python benchmarks/bench_finetune.py [--preset tiny|demo] [--steps 40] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

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


def run_mode(mode: str, moe: Path, data: dict[str, Path], out: Path, args) -> dict:
    cmd = [sys.executable, "-c", CHILD, "finetune", str(moe), str(out), mode, "-q",
           "--steps", str(args.steps), "--seq-len", str(args.seq_len), "--batch-size",
           str(args.batch_size), "--eval-fraction", "0.02", "--device", "cpu"]
    cmd += sum((["--data", f"{d}={p}"] for d, p in data.items()), [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{mode} failed:\n{done.stderr[-3000:]}")
    rss = int(done.stderr.rsplit("MAXRSS_KB", 1)[1].split()[0]) * 1024
    records = [json.loads(x) for x in (out / "training/metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in records if r["type"] == "train"][5:]
    return {"mode": mode, "tokens_per_s": statistics.median(tps), "peak_rss_bytes": rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=["tiny", "demo"], default="demo")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        moe, data = make_moe(args.preset, work)
        runs = [run_mode(m, moe, data, work / m.strip("-"), args)
                for m in ("--router-only", "--full")]
    ratio = runs[0]["tokens_per_s"] / runs[1]["tokens_per_s"]
    result = {"preset": args.preset, "steps": args.steps, "seq_len": args.seq_len,
              "batch_size": args.batch_size, "runs": runs, "router_only_over_full": ratio,
              "target": 1.3, "machine": f"{platform.machine()}, {platform.python_version()}"}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "finetune.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = "\n".join(f"| `{r['mode']}` | {r['tokens_per_s']:,.0f} | "
                     f"{r['peak_rss_bytes'] / 2**20:,.0f} |" for r in runs)
    (RESULTS / "finetune.md").write_text(
        f"# finetune: router-only vs full ({args.preset} MoE, CPU)\n\n"
        f"{args.steps} steps, batch {args.batch_size} × {args.seq_len} tokens, one process.\n\n"
        f"| mode | tokens/s (median) | peak RSS (MiB) |\n|---|---:|---:|\n{rows}\n\n"
        f"router-only / full: **{ratio:.2f}×** (target ≥ 1.3×)\n")
    print((RESULTS / "finetune.md").read_text())


if __name__ == "__main__":
    main()
