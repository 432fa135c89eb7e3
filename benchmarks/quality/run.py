"""Quality of every merge-into-MoE kind, router init and merge method on the toy domain experts,
against the dense merges and a compute-matched dense control: the papers' comparisons
(Branch-Train-Mix, sequence routing, SMEAR / CAMEx, sparse upcycling, TIES / DARE) in
miniature, one run, one machine.

The `quality` preset (default): 4 experts (code, prose, math, C++) of 1.5M parameters (hidden
128, 4 layers) branched from one base; `--preset demo` runs the same rows on the demo's 3
experts of hidden 64. Each domain's held-out text is split: its first third is the validation
text (λ / density of the dense TIES and DARE-TIES merges are tuned on it with `build --tune-on`),
the rest is the test text every row is scored on. Routers are calibrated, and everything is
trained, on the experts' training text.

Per row: per-domain test perplexity (each window read as generation would: a prompt of
--prompt-tokens tokens, where sequence-routed models route, then the rest through the KV cache;
only the tokens after the prompt scored), the mean over domains, and for MoEs whose experts are
the domain experts the share of each domain's routing that goes to its own expert. Rows that
train run with --seeds seeds (build seed and data order): the mean and the min–max over seeds.

Results: benchmarks/results/quality.{md,json,png}; `python benchmarks/quality/report.py`
writes the .md and .png again from the .json.

    python benchmarks/quality/run.py [--preset quality|demo] [--seeds 3] [--steps 80]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]
from models import CONTROLS, TRAINED, Models, add_training_options  # noqa: E402
from report import markdown, plot, summary  # noqa: E402
from stamp import provenance  # noqa: E402

RESULTS = Path(__file__).parent.parent / "results"
ROUTED = ("token_", "seq_", "merged_", "camex_")  # keys of MoEs whose experts are the domains'


# per preset: the options' defaults and the rows it leaves out. On the real base a training
# step is ~30× a toy's: one seed, fewer steps and tokens, a smaller tuning grid and calibration
# sample, no rows whose every weight trains (the full fine-tune and the upcycled MoE: ~15 min
# each), and of the rows that repeat another's question (DARE beside TIES, routers trained from
# random beside from calibrate, merged_experts' routers beside CAMEx's) only one
PRESETS = {
    "quality": ({}, set()),
    "demo": ({}, set()),
    "smollm2": ({"seeds": 1, "steps": 30, "lr": 3e-3, "full_steps": 0, "batch_size": 8,
                 "max_tokens": 2048, "tune_chars": 4000, "tune_lambdas": "0.5,1.0",
                 "tune_densities": "0.5,0.9", "exact_match": 40, "calibration_tokens": 1024,
                 "eval_fraction": 0.005, "gradient_checkpointing": True},
                {"dense+pipeline", "token_cal+r+f", "upcycle+f", "dense_dare", "token_random+r",
                 "merged_cal+r"}),
}


def rows(ts, a, every_row: bool = False) -> list[tuple[str, str, bool]]:
    """(label, model key, trained over seeds) of every row, in the table's order; without
    `every_row`, less the preset's and --skip's."""
    r, f, p = a.steps, a.full_steps, a.steps + a.full_steps
    skipped = set() if every_row else (PRESETS[a.preset][1] | set(filter(None, a.skip.split(","))))
    btx = []
    if hasattr(ts.spec, "steps"):  # real experts: BTX's control, the experts' compute
        n, s = len(ts.experts), ts.spec.steps
        btx = [(f"dense base, FFNs {n}×{s} + {r} steps on all domains (BTX control)",
                "dense_btx", False)]
    every = [
        ("base", "base", False),
        *((f"expert: {d}", f"expert:{d}", False) for d in ts.experts),
        ("dense average", "dense_average", False),
        ("dense TIES, tuned λ / density", "dense_ties", False),
        ("dense DARE-TIES, tuned λ / density", "dense_dare", False),
        (f"dense base + {r} steps (control)", "dense+router", True),
        (f"dense base + {p} steps (control)", "dense+pipeline", True),
        *btx,
        ("token_routed, random router", "token_random", False),
        ("token_routed, prompts router", "token_prompts", False),
        ("token_routed, calibrate (no training)", "token_cal", False),
        ("token_routed, calibrate, shared tensors by TIES, tuned λ / density", "token_cal_ties",
         False),
        (f"token_routed, random + routers {r} steps", "token_random+r", True),
        (f"token_routed, calibrate + routers {r} steps", "token_cal+r", True),
        (f"token_routed, calibrate + routers {r} + full {f} steps", "token_cal+r+f", True),
        ("seq_routed, perplexity", "seq_ppl", False),
        ("seq_routed, task_vector", "seq_tv", False),
        ("seq_routed, learned, calibrate (no training)", "seq_cal", False),
        ("merged_experts, calibrate (no training)", "merged_cal", False),
        (f"merged_experts, calibrate + routers {r} steps", "merged_cal+r", True),
        ("CAMEx, calibrate (no training)", "camex_cal", False),
        (f"CAMEx, calibrate + routers, curvature {r} steps", "camex_cal+rc", True),
        (f"upcycled {len(ts.experts)}× top-2, + full {p} steps", "upcycle+f", True),
    ]
    return [row for row in every if row[1] not in skipped]


def trained_steps(key: str, models: Models) -> int:
    """Training steps behind a model: its fine-tunes' steps, parents included."""
    if key in TRAINED:
        return models.steps(TRAINED[key].phase)[0] + trained_steps(TRAINED[key].parent, models)
    if key == "dense_btx":
        return len(models.ts.experts) * models.ts.spec.steps + models.args.steps
    return models.steps(CONTROLS[key])[0] if key in CONTROLS else 0


def split_held_out(text: str) -> tuple[str, str]:
    """(validation, test): the first third of a held-out text (cut at a line end), the rest."""
    cut = text.index("\n", len(text) // 3) + 1
    return text[:cut], text[cut:]


class Scorer:
    """Test perplexity of one model at a time, where its routers send each domain, and (with
    `exact` > 0) greedy exact match on the math and code test texts."""

    def __init__(self, texts: dict[str, str], args):
        self.texts, self.args = texts, args
        self.kw = {"seq_len": 128, "max_tokens": args.max_tokens,
                   "prompt_tokens": args.prompt_tokens}
        self.items: dict[str, list] = {}

    def __call__(self, key: str, ref) -> tuple[dict, dict | None, dict | None]:
        """({domain: perplexity}, {domain: own-expert share} or None, {task: exact-match
        accuracy} or None)."""
        from moemerge.eval.perplexity import perplexity_table
        from moemerge.loading import load_causal_lm

        model, tokenizer = ref if isinstance(ref, tuple) else load_causal_lm(ref)
        exact = self.exact_match(model, tokenizer)
        if not key.startswith(ROUTED):
            return perplexity_table({key: (model, tokenizer)}, self.texts, **self.kw)[key], \
                None, exact
        from moemerge.analysis.routing import routing_report

        report = routing_report(model, tokenizer, self.texts, labels=list(self.texts), **self.kw)
        # token / sequence level: the share of tokens (windows) whose top-k holds their own
        # expert (each fills k slots, at most one its own); weight level: the mean weight on it
        k = 1 if report.level == "weight" else report.experts_per_token
        own = {d: k * r.mean_share[report.labels.index(d)] for d, r in report.domains.items()}
        return {d: r.perplexity for d, r in report.domains.items()}, own, exact

    def exact_match(self, model, tokenizer) -> dict[str, float] | None:
        """Greedy exact match (moemerge.eval.exact_match): the final value of held-out math
        problems, the next line of held-out code; None without --exact-match items."""
        from moemerge.eval.exact_match import code_items, greedy_matches, math_items

        n = self.args.exact_match
        if not n or not {"math", "code"} & set(self.texts):
            return None
        if not self.items:  # the same items for every model (one tokenizer: the experts')
            if "math" in self.texts:
                self.items["math"] = math_items(self.texts["math"], n)
            if "code" in self.texts:
                self.items["code"] = code_items(self.texts["code"], tokenizer, n)
        return {task: sum(greedy_matches(model, tokenizer, items, line=task == "code"))
                / len(items) for task, items in self.items.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=tuple(PRESETS), default="quality",
                        help="toy experts (quality, demo) or the real SmolLM2 experts (smollm2, "
                        "`moemerge toy DIR --preset smollm2-experts`)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80, help="router / curvature steps")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--full-steps", type=int, default=40)
    parser.add_argument("--full-lr", type=float, default=1e-4)
    add_training_options(parser)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=12000, help="test tokens per domain")
    parser.add_argument("--tune-chars", type=int, default=8000,
                        help="validation characters per domain for λ / density tuning")
    parser.add_argument("--exact-match", type=int, default=0, help="held-out math problems "
                        "and code lines per model scored by greedy exact match (0: none)")
    parser.add_argument("--calibration-tokens", type=int, default=8192,
                        help="calibration tokens per domain for router.init: calibrate")
    parser.add_argument("--tune-lambdas", default="0.3,0.5,0.7,1.0")
    parser.add_argument("--tune-densities", default="0.5,0.7,0.9")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip", default="", help="comma-separated row keys left out of "
                        "the results (e.g. dense_btx, whose training takes ~40 min on 2 cores)")
    parser.add_argument("--only", default="", help="comma-separated row keys (a partial run "
                        "for trying changes; writes no results unless --update)")
    parser.add_argument("--update", action="store_true", help="with --only: add those rows to "
                        "the preset's result files (replacing rows of the same key), each "
                        "stamped with this run's provenance and settings")
    preset = parser.parse_known_args()[0].preset
    parser.set_defaults(**PRESETS[preset][0])
    args = parser.parse_args()
    if args.update and not args.only:
        parser.error("--update adds the rows of an --only run to the result files; give --only")
    torch.set_num_threads(args.threads)
    clock, times = time.perf_counter(), {}

    from moemerge.modeling import register
    from moemerge.toy import DEMO, QUALITY, cached_toy_experts
    from moemerge.tune import TuneOptions

    register()
    if args.preset == "smollm2":
        from moemerge.toy.real_experts import REAL, cached_real_experts

        ts = cached_real_experts(REAL)
        made = json.loads((ts.root / "realset.json").read_text())["seconds"]["total"]
    else:
        ts = cached_toy_experts({"quality": QUALITY, "demo": DEMO}[args.preset], progress=False)
        made = json.loads((ts.root / "toyset.json").read_text())["timings"]["total_s"]
    times["toy experts"] = time.perf_counter() - clock
    held_out = {d: split_held_out(p.read_text()) for d, p in ts.eval_text.items()}
    score = Scorer({d: test for d, (_, test) in held_out.items()}, args)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "validation").mkdir()
        for d, (validation, _) in held_out.items():
            (work / "validation" / f"{d}.txt").write_text(validation[: args.tune_chars])
        tune = TuneOptions(work / "validation", max_tokens=10**6, seq_len=64,
                           lambdas=tuple(map(float, args.tune_lambdas.split(","))),
                           densities=tuple(map(float, args.tune_densities.split(","))))
        models = Models(ts, args, work, tune)
        only = set(filter(None, args.only.split(",")))
        for label, key, trained in rows(ts, args):
            if only and key not in only:
                continue
            start = time.perf_counter()
            row = {"key": key, "per_seed": [], "own": [], "exact": []}
            for seed in range(args.seeds if trained else 1):
                perplexities, own, exact = score(key, models.get(key, seed))
                row["per_seed"].append(perplexities)
                if own is not None:
                    row["own"].append(own)
                if exact is not None:
                    row["exact"].append(exact)
                print(f"{label} (seed {seed}): " + ", ".join(f"{d} {v:.2f}" for d, v in
                                                             perplexities.items()), flush=True)
            row |= {"steps": trained_steps(key, models), "summary": summary(row["per_seed"]),
                    "seconds": round(time.perf_counter() - start, 1)}
            results[label] = row
            if not only:  # after every row: a run killed later (OOM, a deadline) keeps these
                write_results(result_record(args, ts, models, results, clock, times, made,
                                            complete=False))
        result = result_record(args, ts, models, results, clock, times, made, complete=True)
    if args.update:
        result = updated(result, rows(ts, args, every_row=True))
    print(markdown(result))
    print(f"runtime: {result['runtime_s']:.0f} s")
    if not only or args.update:
        write_results(result)


def updated(run: dict, order: list[tuple[str, str, bool]]) -> dict:
    """The preset's saved result with the rows of `run` (an --only run) added, each row keeping
    where it came from (`added`: its run's provenance and settings); rows in the table's order."""
    saved = json.loads((RESULTS / f"{result_name(run['preset'])}.json").read_text())
    for row in run["rows"].values():
        row["added"] = {"provenance": run["provenance"], "settings": run["settings"],
                        "date": run["date"]}
    keys = [key for _, key, _ in order]
    merged = {label: row for label, row in saved["rows"].items()
              if row["key"] not in {r["key"] for r in run["rows"].values()}} | run["rows"]
    saved["rows"] = dict(sorted(merged.items(), key=lambda item: keys.index(item[1]["key"])
                                if item[1]["key"] in keys else len(keys)))
    saved["tuned"] |= run["tuned"]
    return saved


def result_name(preset: str) -> str:
    return "quality-smollm2" if preset == "smollm2" else "quality"


def result_record(args, ts, models, results: dict, clock: float, times: dict, made: float,
                  complete: bool) -> dict:
    """What the result files hold; `complete` False while rows are still to come."""
    return {
        "preset": args.preset, "spec": ts.spec.__dict__ | {"domains": list(ts.spec.domains)},
        "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "transformers": transformers.__version__, "tune_balanced": True,
        "provenance": provenance(), "complete": complete,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} torch "
                   f"thread(s)",
        "settings": {k: v for k, v in vars(args).items() if k not in ("threads", "only")},
        "tuned": {k: {role: list(v) for role, v in chosen.items()}
                  for k, chosen in models.tuned.items()},
        "runtime_s": time.perf_counter() - clock, "toy_s": times["toy experts"],
        # what making the expert set took, whenever it was made (0 above when it was cached)
        "toy_make_s": made,
        "rows": results,
    }


def write_results(result: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    name = result_name(result["preset"])
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown(result))
    plot(result, RESULTS / f"{name}.png")


if __name__ == "__main__":
    main()
