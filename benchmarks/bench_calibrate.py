"""What `router.init: calibrate` costs at real shapes: a token-routed MoE of experts with
Llama-3.2-1B's shapes (bf16, 128256-token tied embedding; layers cut with --layers), built with
random routers and with calibrated ones at several `calibration.max_tokens`, each in a fresh
process: build time, peak RSS and bytes written, against the random-router build of the same
recipe (the build without calibration) measured in the same run.

Calibration text: the quality toy set's training text (code, prose; made offline and cached on
first use), one domain per expert. Results: benchmarks/results/calibrate.{md,json}.

    python benchmarks/bench_calibrate.py [--shape llama-3.2-1b] [--layers 4] [--tokens 1024,4096]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from stamp import provenance, stamp_line

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
CHILD = r"""
import json, os, sys, time
from moemerge.api import build
recipe, out = sys.argv[1], sys.argv[2]
def written():
    return int(next(l for l in open("/proc/self/io") if l.startswith("write_bytes")).split()[1])
w0, t0 = written(), time.perf_counter()
build(recipe, out, progress=False, verify="structure")
os.sync()  # the bytes the page cache still holds count as written
status = open("/proc/self/status").read()
print(json.dumps({"seconds": time.perf_counter() - t0, "written": written() - w0,
                  "peak_rss": int(status.split("VmHWM:")[1].split()[0]) * 1024}))
"""


def run_build(recipe: Path, out: Path, repeats: int) -> dict:
    """Fastest time, highest peak RSS and bytes written over `repeats` fresh processes."""
    runs = []
    for _ in range(repeats):
        done = subprocess.run([sys.executable, "-c", CHILD, str(recipe), str(out)],
                              capture_output=True, text=True, env=os.environ | {
                                  "PYTHONPATH": str(HERE.parent)})
        if done.returncode != 0:
            raise SystemExit(f"{recipe} failed:\n{done.stderr[-3000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        output = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        shutil.rmtree(out)
    return {"seconds": min(r["seconds"] for r in runs), "output": output,
            "peak_rss": max(r["peak_rss"] for r in runs),
            "written": max(r["written"] for r in runs)}


def recipe_text(shapes: dict, data: dict[str, Path], tokens: int | None) -> str:
    experts = "\n".join(f"  - {{model: {path}, name: {domain}}}"
                        for path, domain in zip(shapes["experts"], data, strict=True))
    text = f"kind: moe\nbase_model: {shapes['base']}\nexperts:\n{experts}\nexperts_per_token: 1\n"
    if tokens is None:
        return text + "router: {init: random}\n"
    texts = ", ".join(f"{d}={p}" for d, p in data.items())
    return text + ("router: {init: calibrate}\n"
                   f"calibration: {{data: [{texts}], max_tokens: {tokens}, seq_len: 128}}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", default="1024,4096", help="calibration.max_tokens values")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    from shapes import make_shape_set

    from moemerge.toy import QUALITY, cached_toy_experts

    shapes = make_shape_set(args.shape, 2, layers=args.layers)
    toy = cached_toy_experts(QUALITY, progress=False)
    data = {d: toy.train_text[d] for d in ("code", "prose")}
    rows = {}
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        for tokens in [None, *map(int, args.tokens.split(","))]:
            label = "random routers" if tokens is None else f"calibrate, {tokens} tokens/domain"
            recipe = Path(tmp) / "recipe.yaml"
            recipe.write_text(recipe_text(shapes, data, tokens))
            rows[label] = run_build(recipe, Path(tmp) / "out", args.repeats)
            print(label, json.dumps(rows[label]), flush=True)
    result = {"provenance": provenance(), "shape": args.shape, "layers": args.layers,
              "params_per_model": shapes["made"]["params"], "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "calibrate.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "calibrate.md").write_text(markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    rows = result["rows"]
    plain = rows["random routers"]
    lines = [
        f"# `router.init: calibrate` at {result['shape']}'s shapes ({result['layers']} layers)", "",
        stamp_line(result["provenance"]), "",
        "`python benchmarks/bench_calibrate.py`: a "
        f"token-routed MoE (top-1) of 2 experts with {result['shape']}'s shapes, bf16, "
        f"{result['params_per_model'] / 1e6:.0f}M parameters each, built in a fresh process "
        "(fastest of the repeats; peak RSS the process's VmHWM; bytes written from "
        "/proc/self/io after a sync). Calibration windows of 128 tokens of the quality toy set's "
        "code and prose training text, one domain per expert.", "",
        "| build | time (s) | × random routers | peak RSS (GB) | written (GB) | output (GB) |",
        "|---|---:|---:|---:|---:|---:|"]
    for label, row in rows.items():
        lines.append(f"| {label} | {row['seconds']:.1f} | {row['seconds'] / plain['seconds']:.2f} "
                     f"| {row['peak_rss'] / 1e9:.2f} | {row['written'] / 1e9:.2f} | "
                     f"{row['output'] / 1e9:.2f} |")
    lines += ["", "The calibrated build writes the model once, then the fitted routers over "
              "their placeholders in place: its bytes written match the output's. Its extra time "
              "and memory are the fp32 load of the built model and its forwards over the "
              "calibration windows (about L/2 of them, layer by layer: docs/routing.md)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
