"""Upcycling on the toy set: the demo's dense base made into 4 copies × granularity m (1, 2),
with and without Drop-Upcycling (`reinit: {ratio: 0.5}`), each trained by `finetune --full` (the
upcycling balancing-loss default) for the same steps, learning rate and batches as a dense
control: the base trained by the same loop. Held-out perplexity per domain, several seeds (the
build's router / re-initialisation seed and the data order).

Stages are cached (one JSON per trained model under --cache), so a run that stops is resumed by
running it again; --limit caps the runs one invocation trains (keep each under ~10 minutes on a
shared machine). Results: benchmarks/results/upcycle.{md,json}.

    PYTHONPATH=. python benchmarks/bench_upcycle.py [--seeds 3] [--steps 150] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent / "quality"))
from models import add_training_options, build, finetune, train_dense  # noqa: E402
from stamp import parts_line, provenance, stamp_line  # noqa: E402

RESULTS = Path(__file__).parent / "results"
VARIANTS = {  # key: (label, recipe lines[, finetune config fields])
    "m1": ("upcycled 4×, m = 1", ["granularity: 1"]),
    "m1_drop": ("upcycled 4×, m = 1, Drop-Upcycling 0.5", ["granularity: 1",
                                                         "reinit: {ratio: 0.5}"]),
    "m2": ("upcycled 4×, m = 2", ["granularity: 2"]),
    "m2_drop": ("upcycled 4×, m = 2, Drop-Upcycling 0.5", ["granularity: 2",
                                                         "reinit: {ratio: 0.5}"]),
    "m2_noaux": ("upcycled 4×, m = 2, balancing loss off (ablation)", ["granularity: 2"],
                 {"aux_loss_coef": 0.0}),
}


def upcycle_recipe(ts, lines: list[str], seed: int) -> list[str]:
    return ["kind: upcycle", f"model: {ts.base}", "experts: 4", "experts_per_token: 2",
            "router: {init: virtual_group}", f"seed: {seed}", *lines]


def run_one(key: str, seed: int, ts, args, texts: dict[str, str], work: Path) -> dict:
    """{"start": {domain: ppl} before training, "trained": after} of one variant and seed."""
    from moemerge.eval.perplexity import perplexity_table

    kw = {"seq_len": 128, "max_tokens": args.max_tokens}
    if key == "dense":
        trained = train_dense(ts, ts.base, args.steps, args.lr, seed, args)
        start = ts.base
    else:
        _, lines, *extra = VARIANTS[key]
        start = build(upcycle_recipe(ts, lines, seed), work / f"{key}-{seed}")
        trained = finetune(ts, start, work / f"{key}-{seed}-ft", ["all"], args.steps, args.lr,
                           seed, args, **(extra[0] if extra else {}))
    table = perplexity_table({"start": start, "trained": trained}, texts, **kw)
    return {"start": table["start"], "trained": table["trained"]}


def summarise(runs: list[dict], part: str) -> dict:
    domains = list(runs[0][part])
    per_domain = {d: statistics.mean(r[part][d] for r in runs) for d in domains}
    means = [statistics.mean(r[part].values()) for r in runs]
    return {"per_domain": per_domain, "mean": statistics.mean(means),
            "min": min(means), "max": max(means)}


def markdown(result: dict) -> str:
    s = result["settings"]
    domains = list(result["rows"]["dense"]["trained"]["per_domain"])
    head = "| model | " + " | ".join(domains) + " | mean | min–max over seeds |"
    lines = [
        "# Upcycling on the toy set: 4 copies × m, with and without Drop-Upcycling, against a "
        "dense control", "",
        stamp_line(result["provenance"]), "", parts_line(
            {f"{k} seed {i}": r.get("provenance") for k, row in result["rows"].items()
             for i, r in enumerate(row["per_seed"])}, "trained runs"), "",
        f"`python benchmarks/bench_upcycle.py --seeds {s['seeds']} --steps {s['steps']}`. "
        "The demo's dense "
        "base (Llama, hidden 64, 2 layers, d_ff 256, vocab 2048) made into 4 copies of its FFN "
        "× granularity m (k = 2 copies per token: top-2·m of 4·m experts, `virtual_group` "
        "router), with and without Drop-Upcycling (`reinit: {ratio: 0.5}`); each trained by "
        f"`moemerge finetune --full` for {s['steps']} steps (lr {s['lr']:g}, batch "
        f"{s['batch_size']} × {s['seq_len']} tokens, warm-up + cosine, on the code, prose and "
        "math training text; the balancing-loss default of upcycled models, 0.04 / (2·m)). The "
        "dense control is the base trained by the same loop with the same steps, lr, batches "
        f"and seeds. Held-out perplexity per domain ({s['max_tokens']} tokens each, windows of "
        f"128), mean over {s['seeds']} seeds (build seed and data order), and the range of the "
        "per-seed means.", "",
        "## After training", "", head, "|---|" + "---|" * (len(domains) + 2)]
    for part, title in (("trained", None), ("start", "## At the start (before training)")):
        if title:
            lines += ["", title, "", head, "|---|" + "---|" * (len(domains) + 2)]
        for row in result["rows"].values():
            r = row[part]
            lines.append(f"| {row['label']} | " + " | ".join(
                f"{r['per_domain'][d]:.2f}" for d in domains)
                + f" | {r['mean']:.2f} | {r['min']:.2f}–{r['max']:.2f} |")
    lines += ["", "## Reading it", "", *result.get("reading", ["(to be written)"]), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=1e-3)
    add_training_options(parser)
    parser.add_argument("--max-tokens", type=int, default=8000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=0, help="train at most N runs, then stop")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/moemerge-bench-upcycle"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from moemerge.toy import DEMO, cached_toy_experts

    ts = cached_toy_experts(DEMO, progress=False)
    texts = {d: p.read_text() for d, p in ts.eval_text.items()}
    settings = {k: v for k, v in vars(args).items() if k not in ("threads", "limit", "cache")}
    cache = args.cache / json.dumps(settings, sort_keys=True).encode().hex()[:40]
    cache.mkdir(parents=True, exist_ok=True)
    done, started = 0, time.perf_counter()
    for seed in range(args.seeds):
        for key in ("dense", *VARIANTS):
            file = cache / f"{key}-{seed}.json"
            if file.exists():
                continue
            if args.limit and done >= args.limit:
                print(f"stopped after {done} runs ({time.perf_counter() - started:.0f} s); "
                      "run again to go on")
                return
            with tempfile.TemporaryDirectory() as tmp:
                clock = time.perf_counter()
                row = run_one(key, seed, ts, args, texts, Path(tmp))
            row["seconds"] = time.perf_counter() - clock
            row["provenance"] = provenance()
            file.write_text(json.dumps(row))
            done += 1
            print(f"{key} seed {seed}: {row['seconds']:.0f} s, trained "
                  + ", ".join(f"{d} {v:.2f}" for d, v in row["trained"].items()), flush=True)
    runs = {key: [json.loads((cache / f"{key}-{s}.json").read_text())
                  for s in range(args.seeds)] for key in ("dense", *VARIANTS)}
    labels = {"dense": "dense control (base + same training)"} | {
        k: v[0] for k, v in VARIANTS.items()}
    result = {
        "provenance": provenance(), "settings": settings,
        "train_seconds": sum(r["seconds"] for v in runs.values() for r in v),
        "rows": {k: {"label": labels[k], "trained": summarise(v, "trained"),
                     "start": summarise(v, "start"), "per_seed": v} for k, v in runs.items()},
    }
    old = RESULTS / "upcycle.json"
    if old.exists():  # the reading is written by hand; keep it across re-runs
        result["reading"] = json.loads(old.read_text()).get("reading", [])
    RESULTS.mkdir(exist_ok=True)
    old.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    (RESULTS / "upcycle.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
