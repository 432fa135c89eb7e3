"""`moemerge shrink` on the quality benchmark's experts: held-out perplexity per domain against the
number of experts kept, for prune and merge, with and without router repair, beside the unshrunk
MoE and the dense models with as many active parameters as one expert per token.

The MoE is the quality benchmark's `token_cal` row: the set's four domain experts (code, prose,
math, C++) as a Mixtral, top-2, non-FFN tensors averaged, routers calibrated on the experts'
training text. It is shrunk to each K of --kept (K = 1 clips experts_per_token to 1) with the
same training text as calibration, and every model is scored on the test part of the held-out
text exactly as run.py scores its rows (windows of 129 tokens, a 32-token prompt, the rest
scored). The routing-statistics pass is timed and its peak resident memory read from the
kernel (VmHWM, reset before the pass).

    python benchmarks/quality/shrink.py [--preset quality|smollm2] [--kept 3,2,1]

Results: benchmarks/results/shrink-{preset}.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]
from models import build, recipes  # noqa: E402
from run import Scorer, split_held_out  # noqa: E402
from stamp import provenance, stamp_line  # noqa: E402

RESULTS = Path(__file__).parent.parent / "results"
# (label, method, saliency, repair): the variants of every K; index 3 is shrink's default
VARIANTS = [
    ("prune, REAP, repaired", "prune", "reap", True),
    ("prune, REAP, no repair", "prune", "reap", False),
    ("prune, frequency, repaired", "prune", "frequency", True),
    ("merge, REAP-weighted, repaired", "merge", "reap", True),
    ("merge, REAP-weighted, no repair", "merge", "reap", False),
]
PRESETS = {"quality": {"max_tokens": 12000, "calibration_tokens": 8192},
           "smollm2": {"max_tokens": 2048, "calibration_tokens": 1024}}


def peak_rss_reset() -> None:
    """Start a new VmHWM period (Linux: writing 5 to clear_refs resets the peak RSS)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


class TimedStats:
    """moemerge.built.shrink's statistics pass, timed and its peak RSS read, per call."""

    def __init__(self, collect):
        self.collect, self.calls = collect, []

    def __call__(self, *args, **kw):
        peak_rss_reset()
        start = time.perf_counter()
        stats = self.collect(*args, **kw)
        self.calls.append({"seconds": time.perf_counter() - start, "peak_gib": peak_rss_gib()})
        return stats


def parameters(model: Path) -> tuple[float, float]:
    """(total, active per token) parameters in millions, from config.json (Llama-family dense
    or Mixtral: each expert is 3·H·I per layer, k of E active)."""
    from moemerge.io.reader import CheckpointReader

    config = json.loads((model / "config.json").read_text())
    with CheckpointReader(model) as reader:
        total = sum(math.prod(reader.meta(name).shape) for name in reader.names())
    experts = config.get("num_local_experts", 1)
    k = min(config.get("num_experts_per_tok", 1), experts)
    per_expert = 3 * config["hidden_size"] * config["intermediate_size"]
    idle = config["num_hidden_layers"] * (experts - k) * per_expert
    return total / 1e6, (total - idle) / 1e6


def expert_set(args) -> tuple[object, Scorer]:
    """(the preset's expert set, its scorer on the test part of the held-out text); the
    preset's defaults filled into `args` where the command line gave none."""
    from moemerge.toy import QUALITY, cached_toy_experts

    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.exact_match = 0
    if args.preset == "smollm2":
        from moemerge.toy.real_experts import REAL, cached_real_experts

        ts = cached_real_experts(REAL)
    else:
        ts = cached_toy_experts(QUALITY, progress=False)
    tests = {d: split_held_out(p.read_text())[1] for d, p in ts.eval_text.items()}
    return ts, Scorer(tests, args)


def shrink_once(moe: Path, out: Path, kept: int, method: str, saliency: str, repair: bool,
                data: list[str], tokens: int) -> float:
    """Seconds `moemerge shrink` took (statistics, write, repair; no load check)."""
    from moemerge.built.shrink import recipe_text_of, shrink
    from moemerge.recipe.load import parse_recipe

    recipe = parse_recipe({"kind": "shrink", "model": str(moe), "experts": kept,
                           "method": method, "saliency": saliency, "repair": repair,
                           "calibration": {"data": data, "max_tokens": tokens,
                                           "seq_len": 128}}, "bench")
    start = time.perf_counter()
    shrink(recipe, out, recipe_dir=moe.parent, recipe_text=recipe_text_of(recipe, moe, data),
           verify=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=tuple(PRESETS), default="quality")
    parser.add_argument("--kept", default="3,2,1", help="experts kept per layer, comma-separated")
    parser.add_argument("--variants", default=",".join(str(i) for i in range(len(VARIANTS))),
                        help="which of VARIANTS to run, by index, comma-separated (default: "
                        "all)")
    parser.add_argument("--max-tokens", type=int, help="test tokens per domain")
    parser.add_argument("--calibration-tokens", type=int,
                        help="tokens per domain for the MoE's routers and for shrink")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    args = parser.parse_args()
    clock = time.perf_counter()

    import moemerge.built.shrink as shrink_module

    timed = TimedStats(shrink_module.collect_stats)
    shrink_module.collect_stats = timed
    ts, score = expert_set(args)
    data = [f"{d}={p}" for d, p in ts.train_text.items()]
    rows: list[dict] = []

    def add(label: str, model: Path, **extra) -> None:
        perplexity = score(label, model)[0]
        total, active = parameters(model)
        rows.append({"model": label, "perplexity": perplexity, "total_m": total,
                     "active_m": active, **extra})
        print(f"{label}: " + ", ".join(f"{d} {v:.2f}" for d, v in perplexity.items())
              + f" (mean {mean(perplexity):.3f})", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-shrink-") as tmp:
        work = Path(tmp)
        every = recipes(ts, 0, args.prompt_tokens, args.calibration_tokens)
        moe = build(every["token_cal"], work / "moe")
        experts = len(ts.experts)
        add("base (dense)", ts.base, kept=None)
        add("dense average (dense)", build(every["dense_average"], work / "dense"), kept=None)
        add(f"unshrunk MoE ({experts} experts, top-2)", moe, kept=experts)
        for kept in map(int, args.kept.split(",")):
            for label, method, saliency, repair in (VARIANTS[int(i)]
                                                    for i in args.variants.split(",")):
                out = work / f"k{kept}-{method}-{saliency}-{repair}"
                seconds = shrink_once(moe, out, kept, method, saliency, repair, data,
                                      args.calibration_tokens)
                add(f"K = {kept}: {label}", out, kept=kept, variant=label,
                    shrink_s=round(seconds, 1), stats=timed.calls[-1])
                shutil.rmtree(out)
    result = {"provenance": provenance(), "preset": args.preset, "set": str(ts.root),
              "experts": experts, "test_tokens": args.max_tokens,
              "calibration_tokens": args.calibration_tokens,
              "runtime_s": round(time.perf_counter() - clock), "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    name = f"shrink-{args.preset}"
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown(result, args))
    print(markdown(result, args))


def mean(perplexity: dict[str, float]) -> float:
    return sum(perplexity.values()) / len(perplexity)


def markdown(result: dict, args) -> str:
    rows = result["rows"]
    domains = list(rows[0]["perplexity"])
    head = ("| model | params (M), total / active | " + " | ".join(domains)
            + " | mean | shrink s | statistics pass s / peak RSS GiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        p = r["perplexity"]
        stats = r.get("stats")
        lines.append(f"| {r['model']} | {r['total_m']:.1f} / {r['active_m']:.1f} | "
                     + " | ".join(f"{p[d]:.2f}" for d in domains) + f" | {mean(p):.3f} | "
                     + (f"{r['shrink_s']:.1f} | {stats['seconds']:.1f} / "
                        f"{stats['peak_gib']:.2f} |" if stats else "– | – |"))
    command = (f"python benchmarks/quality/shrink.py --preset {args.preset} --kept {args.kept}"
               f" --variants {args.variants} --max-tokens {args.max_tokens} "
               f"--calibration-tokens {args.calibration_tokens}")
    return (f"# moemerge shrink: perplexity against experts kept ({result['preset']} set)\n\n"
            f"{stamp_line(result['provenance'])}\n\n`{command}` ({result['runtime_s']} s)\n\n"
            f"Test perplexity per domain ({result['test_tokens']} test tokens per domain, "
            f"32-token prompt, as benchmarks/quality/run.py scores); calibration: the experts' "
            f"training text, {result['calibration_tokens']} tokens per domain, for the MoE's "
            "routers and for shrink. Peak RSS is the whole process's during the statistics "
            "pass (the MoE loaded in it included).\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
