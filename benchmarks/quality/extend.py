"""`moemerge extend` on the quality benchmark's experts: a three-expert MoE grown by the fourth,
against the three-expert MoE and a from-scratch build of all four, per domain, and the time of
each way against the rebuild.

The MoEs are the quality benchmark's `token_cal` row (a Mixtral, top-2, non-FFN tensors
averaged, routers calibrated on the experts' training text): built with the first three
experts of the set, then extended by the last with `--keep-shared` (the average stays the three
experts', as the extended model's recipe copy says) in both router modes, and by default (the
shared tensors averaged again with the fourth, routers calibrated again: a rebuild's model),
and built from scratch with all four. Every model is scored
on the test part of the held-out text exactly as run.py scores its rows.

    python benchmarks/quality/extend.py [--preset quality|smollm2]

Results: benchmarks/results/extend-{preset}.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]
from models import build, recipes  # noqa: E402
from shrink import PRESETS, expert_set, mean  # noqa: E402
from stamp import provenance, stamp_line  # noqa: E402

RESULTS = Path(__file__).parent.parent / "results"


def without(ts, left_out: str) -> SimpleNamespace:
    """The set `ts` as recipes() reads it, without the expert `left_out` and its text."""
    return SimpleNamespace(base=ts.base, **{field: {d: p for d, p in getattr(ts, field).items()
                                                   if d != left_out}
                                           for field in ("experts", "train_text")})


def timed(run) -> tuple[object, float]:
    start = time.perf_counter()
    value = run()
    return value, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=tuple(PRESETS), default="quality")
    parser.add_argument("--max-tokens", type=int, help="test tokens per domain")
    parser.add_argument("--calibration-tokens", type=int, help="calibration tokens per domain")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    args = parser.parse_args()
    clock = time.perf_counter()

    from moemerge.built.extend.command import extend_moe

    ts, score = expert_set(args)
    new = list(ts.experts)[-1]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-extend-") as tmp:
        work = Path(tmp)
        four, three = (recipes(s, 0, args.prompt_tokens, args.calibration_tokens)["token_cal"]
                       for s in (ts, without(ts, new)))
        three = build(three, work / "three")

        def grow(out: str, keep_shared: bool = True, recalibrate: bool = False) -> Path:
            extend_moe(three, work / out, [ts.experts[new]], names=[new],
                       calibration=[f"{new}={ts.train_text[new]}"], keep_shared=keep_shared,
                       recalibrate=recalibrate)
            return work / out

        extended, fast_s = timed(lambda: grow("extended"))
        recalibrated, exact_s = timed(lambda: grow("recalibrated", recalibrate=True))
        remerged, remerge_s = timed(lambda: grow("remerged", keep_shared=False))
        rebuilt, rebuild_s = timed(lambda: build(four, work / "four"))
        for label, model, seconds in [
                (f"3 experts (no {new})", three, None),
                (f"extended by {new}, --keep-shared (fast)", extended, fast_s),
                (f"extended by {new}, --keep-shared --recalibrate", recalibrated, exact_s),
                (f"extended by {new}, shared tensors re-merged (the default)", remerged,
                 remerge_s),
                ("built from scratch with 4 experts", rebuilt, rebuild_s)]:
            perplexity = score(label, model)[0]
            rows.append({"model": label, "perplexity": perplexity, "seconds": seconds})
            print(f"{label}: " + ", ".join(f"{d} {v:.2f}" for d, v in perplexity.items())
                  + f" (mean {mean(perplexity):.3f})", flush=True)
    result = {"provenance": provenance(), "preset": args.preset, "set": str(ts.root),
              "new_expert": new, "test_tokens": args.max_tokens,
              "calibration_tokens": args.calibration_tokens,
              "runtime_s": round(time.perf_counter() - clock), "rows": rows}
    name = f"extend-{args.preset}"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown(result, args))
    print(markdown(result, args))


def markdown(result: dict, args) -> str:
    rows = result["rows"]
    domains = list(rows[0]["perplexity"])
    rebuild = rows[-1]["seconds"]
    head = "| model | " + " | ".join(domains) + " | mean | seconds | / rebuild |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        p, s = r["perplexity"], r["seconds"]
        lines.append(f"| {r['model']} | " + " | ".join(f"{p[d]:.2f}" for d in domains)
                     + f" | {mean(p):.3f} | "
                     + (f"{s:.1f} | {s / rebuild:.2f} |" if s is not None else "– | – |"))
    command = (f"python benchmarks/quality/extend.py --preset {args.preset} --max-tokens "
               f"{args.max_tokens} --calibration-tokens {args.calibration_tokens}")
    return (f"# moemerge extend: a fourth expert added, against a rebuild ({result['preset']} "
            f"set)\n\n{stamp_line(result['provenance'])}\n\n`{command}` "
            f"({result['runtime_s']} s)\n\nTest perplexity per domain ({result['test_tokens']} "
            "test tokens per domain, 32-token prompt, as benchmarks/quality/run.py scores). "
            f"Calibration: the experts' training text, {result['calibration_tokens']} tokens "
            "per domain. `--keep-shared` keeps the three-expert average of the shared "
            "tensors; the default re-merges them with the new expert, as the rebuild (four) "
            "does. Seconds: one run each, in one process, on the same machine.\n\n"
            + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
