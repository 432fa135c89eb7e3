"""Sequence-routed kinds on the toy domain experts: quality without training, and the inference
cost of routing. One run, one machine; results in benchmarks/results/sequence.{json,md}.

Quality: per-domain perplexity of the base, each expert, a token-routed MoE (average-merged
non-FFN, random router), seq_routed with perplexity and with task-vector routing (each expert
keeping its own embedding and head, and with merged ones), and bridged before fine-tuning
(identity projectors). Every model reads each 129-token window as generation would: a prompt
of the first --prompt-tokens tokens (where the sequence-routed models choose their experts),
then the rest through the KV cache; only the tokens after the prompt are scored.

Cost: time of a forward on a prompt (and of generate()) by seq_routed with each router, as a
ratio to the same call on one dense expert (median of --repeats runs, in one process).

    python benchmarks/bench_sequence.py [--preset demo|tiny] [--prompt-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from stamp import provenance, stamp_line

RESULTS = Path(__file__).parent / "results"


def build_models(ts, work: Path) -> dict[str, Path]:
    """{label: model dir} of every MoE compared, built from the toy set `ts`."""
    from moemerge.api import build

    experts = [f"  - {{model: {p}, name: {d}}}" for d, p in ts.experts.items()]
    recipes = {
        "token_routed, random router": ["experts_per_token: 2", "router: {init: random}"],
        "seq_routed, perplexity": ["assembly: seq_routed", "per_expert: [embed, lm_head]",
                                   "router: {kind: perplexity}"],
        "seq_routed, task_vector": ["assembly: seq_routed", "per_expert: [embed, lm_head]",
                                    "router: {kind: task_vector}"],
        "seq_routed, perplexity, merged embed/head": ["assembly: seq_routed",
                                                      "router: {kind: perplexity}"],
        "bridged, learned random router (before fine-tuning)": ["assembly: bridged"],
    }
    out = {}
    for i, (label, extra) in enumerate(recipes.items()):
        base = [] if "bridged" in label else [f"base_model: {ts.base}"]
        text = "\n".join(["kind: moe", *base, "experts:", *experts, *extra]) + "\n"
        (work / f"r{i}.yaml").write_text(text)
        build(work / f"r{i}.yaml", work / f"m{i}", progress=False)
        out[label] = work / f"m{i}"
    return out


def quality(ts, moes: dict[str, Path], prompt_tokens: int, max_tokens: int) -> dict:
    from moemerge.eval.perplexity import perplexity_table

    models = {"base": ts.base, **{f"expert: {d}": p for d, p in ts.experts.items()}, **moes}
    texts = {d: p.read_text() for d, p in ts.eval_text.items()}
    return perplexity_table(models, texts, seq_len=128, max_tokens=max_tokens,
                            prompt_tokens=prompt_tokens)


def _median_time(call, repeats: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def cost(ts, seq_dir: Path, prompt_len: int, new_tokens: int, repeats: int) -> list[dict]:
    """Forward on a prompt and generate(), each router against one dense expert."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(seq_dir)
    text = next(iter(ts.eval_text.values())).read_text()
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :prompt_len]
    dense = AutoModelForCausalLM.from_pretrained(next(iter(ts.experts.values()))).eval()
    gen = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False}
    rows = []
    for router in ("learned", "perplexity", "task_vector"):
        moe = AutoModelForCausalLM.from_pretrained(seq_dir, router=router).eval()
        forward = [_median_time(lambda m=m: m(input_ids=ids), repeats) for m in (dense, moe)]
        generate = [_median_time(lambda m=m: m.generate(ids, **gen), max(3, repeats // 4))
                    for m in (dense, moe)]
        rows.append({"router": router, "prompt_tokens": prompt_len, "new_tokens": new_tokens,
                     "forward_s": forward, "forward_ratio": forward[1] / forward[0],
                     "generate_s": generate, "generate_ratio": generate[1] / generate[0]})
    # as before ‖τ_e‖ was cached: recomputed on every routed call
    def uncached(call):
        def run():
            if moe._scorer is not None:
                moe._scorer._norms = None
            return call()
        return run

    forward = [_median_time(uncached(lambda m=m: m(input_ids=ids)), repeats) for m in (dense, moe)]
    generate = [_median_time(uncached(lambda m=m: m.generate(ids, **gen)), max(3, repeats // 4))
                for m in (dense, moe)]
    rows.append({"router": "task_vector, ‖τ_e‖ recomputed per call (before caching)",
                 "prompt_tokens": prompt_len, "new_tokens": new_tokens,
                 "forward_s": forward, "forward_ratio": forward[1] / forward[0],
                 "generate_s": generate, "generate_ratio": generate[1] / generate[0]})
    return rows


def markdown(result: dict) -> str:
    table, domains = result["perplexity"], list(next(iter(result["perplexity"].values())))
    lines = [f"# Sequence-routed kinds: quality and routing cost ({result['preset']} toy experts)",
             "", stamp_line(result["provenance"]), "",
             f"Perplexity on held-out text, windows of 129 tokens: the first "
             f"{result['prompt_tokens']} are the prompt (where sequence-routed models choose "
             "their experts), the rest are scored through the KV cache. Lower is better.", "",
             "| model | " + " | ".join(domains) + " | mean |",
             "|---|" + "---:|" * (len(domains) + 1)]
    for label, row in table.items():
        values = [row[d] for d in domains]
        lines.append(f"| {label} | " + " | ".join(f"{v:.2f}" for v in values)
                     + f" | {sum(values) / len(values):.2f} |")
    lines += ["", "Inference cost of routing, seq_routed (k = 1) against one dense expert "
              "(median times, same process):", "",
              "| router | forward on a prompt | generate() |", "|---|---:|---:|"]
    for row in result["cost"]:
        lines.append(f"| {row['router']} | {row['forward_ratio']:.2f}× "
                     f"({row['prompt_tokens']} tokens) | {row['generate_ratio']:.2f}× "
                     f"({row['prompt_tokens']} + {row['new_tokens']} tokens) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=("demo", "tiny"), default="demo")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=20000)
    parser.add_argument("--cost-prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)

    from moemerge.modeling import register
    from moemerge.toy import DEMO, TINY, cached_toy_experts

    register()
    ts = cached_toy_experts({"demo": DEMO, "tiny": TINY}[args.preset], progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        moes = build_models(ts, Path(tmp))
        result = {
            "provenance": provenance(), "preset": args.preset,
            "prompt_tokens": args.prompt_tokens,
            "perplexity": quality(ts, moes, args.prompt_tokens, args.max_tokens),
            "cost": cost(ts, moes["seq_routed, task_vector"], args.cost_prompt,
                         args.new_tokens, args.repeats),
        }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sequence.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "sequence.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
