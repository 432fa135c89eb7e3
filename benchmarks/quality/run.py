"""Quality of every merge-into-MoE kind and merge method on the toy domain experts: the papers'
comparisons (Branch-Train-Mix, sequence routing, bridged experts, SMEAR / CAMEx, dense
TIES / DARE merges, a compute-matched dense control) in miniature, one run, one machine.

Per-domain held-out perplexity (each window read as generation would: a prompt of
--prompt-tokens tokens, where sequence-routed models route, then the rest through the KV cache;
only the tokens after the prompt scored) and the mean over domains, for: the base, each expert,
dense TIES and DARE-TIES merges; token-routed MoEs (average / TIES / DARE-TIES non-FFN merge,
random router), the average one after router-only training and then a short full fine-tune;
router set by `calibrate` (closed form, no training); seq_routed with perplexity, task-vector
and calibrated learned routing; bridged with a narrower expert (least-
squares projectors, then routers + projectors trained); merged_experts with routers trained, without
and with curvature; and the base trained further on the same data as the full fine-tune (the
compute-matched dense control). Fine-tuned rows run with --seeds seeds (build seed and data
order) and report the mean and the min–max over seeds.

Results: benchmarks/results/quality.{md,json,png}.

    python benchmarks/quality/run.py [--seeds 3] [--steps 80] [--full-steps 40]
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

sys.path.insert(0, str(Path(__file__).parent))
from models import build, finetune, recipes, same_vocabulary, train_dense  # noqa: E402
from report import markdown, plot, summary  # noqa: E402

RESULTS = Path(__file__).parent.parent / "results"


class Scorer:
    """Perplexity of one model at a time; rows {label: [per-seed {domain: ppl}]}."""

    def __init__(self, ts, args):
        self.texts = {d: p.read_text() for d, p in ts.eval_text.items()}
        self.kw = {"seq_len": 128, "max_tokens": args.max_tokens,
                   "prompt_tokens": args.prompt_tokens}
        self.rows: dict[str, list[dict[str, float]]] = {}

    def __call__(self, label: str, ref) -> None:
        from moemerge.eval.perplexity import perplexity_table

        row = perplexity_table({label: ref}, self.texts, **self.kw)[label]
        self.rows.setdefault(label, []).append(row)
        print(f"{label}: " + ", ".join(f"{d} {v:.2f}" for d, v in row.items()), flush=True)


def narrow_experts(ts, args, notes: list[str]) -> dict[str, Path]:
    """The bridged experts: the DEMO code and prose experts and a narrower math expert (a toy
    set of the same spec at another width, trained and cached on first use) when its tokenizer
    is the DEMO one; else all three DEMO experts."""
    from dataclasses import replace

    from moemerge.toy import cached_toy_experts

    spec = replace(ts.spec, hidden=args.narrow_hidden, intermediate=4 * args.narrow_hidden)
    narrow = cached_toy_experts(spec, progress=False)
    if same_vocabulary(ts.base, narrow.base):
        return {"code": ts.experts["code"], "prose": ts.experts["prose"],
                "math": narrow.experts["math"]}
    notes.append(f"the hidden-{args.narrow_hidden} toy set has another vocabulary: bridged "
                 "uses the three DEMO experts")
    return dict(ts.experts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80, help="router/projector/curvature steps")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--full-steps", type=int, default=40)
    parser.add_argument("--full-lr", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--eval-fraction", type=float, default=0.02)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=20000)
    parser.add_argument("--narrow-hidden", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock, times, notes = time.perf_counter(), {}, []

    def stage(name: str) -> None:
        times[name] = time.perf_counter() - clock - sum(times.values())

    from moemerge.modeling import register
    from moemerge.toy import DEMO, cached_toy_experts

    register()
    ts = cached_toy_experts(DEMO, progress=False)
    narrow = narrow_experts(ts, args, notes)
    stage("toy experts")
    score = Scorer(ts, args)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        built = {k: build(v, work / f"s0-{k}")
                 for k, v in recipes(ts, narrow, 0, args.prompt_tokens).items()}
        stage("builds")
        score("base", ts.base)
        for d, p in ts.experts.items():
            score(f"expert: {d}", p)
        if narrow["math"] != ts.experts["math"]:
            score(f"expert: math (hidden {args.narrow_hidden}, for bridged)", narrow["math"])
        score("dense TIES (λ 0.5, d 0.7)", built["dense_ties"])
        score("dense DARE-TIES (λ 0.5, d 0.7)", built["dense_dare"])
        for s in range(args.seeds):
            for steps in (args.full_steps, args.steps + args.full_steps):
                score(f"dense base + {steps} steps (control)",
                      train_dense(ts, ts.base, steps, args.full_lr, s, args))
        stage("dense")
        score("token_routed, average, random router", built["token_avg"])
        score("token_routed, TIES, random router", built["token_ties"])
        score("token_routed, DARE-TIES, random router", built["token_dare"])
        score("token_routed, average, calibrate (no training)", built["token_cal"])
        for s in range(args.seeds):
            moe = built["token_avg"] if s == 0 else build(recipes(ts, narrow, s)["token_avg"],
                                                          work / f"s{s}-token_avg")
            routed = finetune(ts, moe, work / f"ft{s}-router", ["routers"], args.steps, args.lr,
                              s, args)
            score(f"token_routed, average, + routers {args.steps} steps", routed)
            full = finetune(ts, routed, work / f"ft{s}-full", ["all"], args.full_steps,
                            args.full_lr, s, args)
            score(f"token_routed, average, + routers, + full {args.full_steps} steps", full)
        stage("token_routed")
        score("seq_routed, perplexity", built["seq_ppl"])
        score("seq_routed, task_vector", built["seq_tv"])
        score("seq_routed, learned, calibrate (no training)", built["seq_cal"])
        stage("seq_routed")
        score("bridged, least-squares projectors, random router", built["bridged"])
        score("bridged, least-squares projectors, calibrate (no training)", built["bridged_cal"])
        for s in range(args.seeds):
            tuned = finetune(ts, built["bridged"], work / f"ft{s}-bridged",
                             ["routers", "projectors"], args.steps, args.lr, s, args)
            score(f"bridged, + routers, projectors {args.steps} steps", tuned)
        stage("bridged")
        score("merged_experts, before training", built["merged_none"])
        score("merged_experts, calibrate (no training)", built["merged_cal"])
        for key, parts, label in (("merged_none", ["routers"], "routers"),
                                  ("merged_ca", ["routers", "curvature"], "routers, curvature")):
            for s in range(args.seeds):
                tuned = finetune(ts, built[key], work / f"ft{s}-{key}", parts, args.steps,
                                 args.lr, s, args)
                score(f"merged_experts{' + curvature' if key == 'merged_ca' else ''}, "
                      f"+ {label} {args.steps} steps", tuned)
        stage("merged_experts")
    result = {
        "preset": "demo", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {args.threads} torch "
                   f"thread(s)",
        "settings": {k: v for k, v in vars(args).items() if k != "threads"},
        "bridged_experts": {d: str(p.relative_to(p.parents[2])) for d, p in narrow.items()},
        "runtime_s": time.perf_counter() - clock, "times_s": times, "notes": notes,
        "rows": {k: {"per_seed": v, "summary": summary(v)} for k, v in score.rows.items()},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "quality.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    (RESULTS / "quality.md").write_text(markdown(result))
    plot(result, RESULTS / "quality.png")
    print(markdown(result))
    print(f"runtime: {result['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
