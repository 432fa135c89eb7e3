"""Qwen2 -> Qwen2-MoE on the toy set: held-out perplexity per `shared_expert` choice (none /
base / average), untrained random routers, a few router seeds. Writes
benchmarks/results/shared_expert.md.

    PYTHONPATH=. python benchmarks/bench_shared_expert.py [--spec tiny|demo] [--seeds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

from stamp import provenance, stamp_line

RESULTS = Path(__file__).parent / "results" / "shared_expert.md"
CHOICES = ("none", "base", "average")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", choices=("tiny", "demo"), default="demo")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8000)
    args = parser.parse_args()

    from moemerge.api import build
    from moemerge.eval.perplexity import perplexity_table
    from moemerge.toy import DEMO, TINY, cached_toy_experts

    spec = replace(DEMO if args.spec == "demo" else TINY, family="qwen2")
    ts = cached_toy_experts(spec, progress=False)
    texts = {d: p.read_text() for d, p in ts.eval_text.items()}
    kw = {"seq_len": 128, "max_tokens": args.max_tokens}

    def mean_ppl(path) -> tuple[float, dict[str, float]]:
        row = next(iter(perplexity_table({"m": path}, texts, **kw).values()))
        return statistics.mean(row.values()), row

    rows = [("dense base", *mean_ppl(ts.base))]
    with tempfile.TemporaryDirectory() as tmp:
        for choice in CHOICES:
            runs = []
            for seed in range(args.seeds):
                recipe = Path(tmp) / f"{choice}-{seed}.yaml"
                experts = "".join(f"  - {p}\n" for p in ts.experts.values())
                recipe.write_text(f"kind: moe\nbase_model: {ts.base}\nexperts:\n{experts}"
                                  f"experts_per_token: 2\nshared_expert: {choice}\nseed: {seed}\n")
                out = Path(tmp) / f"{choice}-{seed}"
                build(recipe, out, progress=False, warn=lambda _: None)
                runs.append(mean_ppl(out))
            per_domain = {d: statistics.mean(r[1][d] for r in runs) for d in texts}
            rows.append((f"shared_expert: {choice}", statistics.mean(r[0] for r in runs),
                         per_domain, [r[0] for r in runs]))
    lines = [
        "# Qwen2-MoE shared expert: none vs base vs average (untrained routers)", "",
        stamp_line(provenance()), "",
        f"Toy set `{args.spec}` with family qwen2 (hidden {spec.hidden}, {spec.layers} layers, "
        f"3 domain experts branched from one base), 3 experts, k = 2, random routers, "
        f"{args.seeds} router seeds; held-out perplexity, {args.max_tokens} tokens per domain, "
        "windows of 128. `python benchmarks/bench_shared_expert.py --spec "
        f"{args.spec} --seeds {args.seeds}`.", "",
        "| model | mean | " + " | ".join(texts) + " | per seed |",
        "|---|---|" + "---|" * len(texts) + "---|",
    ]
    for label, mean, per_domain, *seeds in rows:
        runs = ", ".join(f"{v:.2f}" for v in seeds[0]) if seeds else ""
        lines.append(f"| {label} | {mean:.2f} | "
                     + " | ".join(f"{per_domain[d]:.2f}" for d in texts) + f" | {runs} |")
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
