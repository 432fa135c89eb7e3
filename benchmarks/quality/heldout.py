"""Issue 44's held-out protocol: are the defaults good on domains they were not chosen on?

An independent replication found that on new domains a compute-matched dense model (Branch-
Train-Mix's control: the base trained on the mixture with the experts' total compute) beat the
training-free token-routed MoE. The README's defaults were chosen on code / prose / math / C++.
Here every row is measured on two domain sets, each a toy expert set of its own
(`moemerge.toy.cached_toy_experts`, the DEMO size unless --spec tiny), over --seeds seeds (a
seed changes the data sample, the initialisation and the data order):

- "chosen":   code, prose, math, cpp  (the set the defaults were chosen on)
- "held-out": stubs, markdown, tests  (moemerge.toy.corpora.HELD_OUT_DOMAINS: none chosen on)

Rows (keys for --only):

- `oracle`: each domain scored by its own expert alone;
- `base`; `dense_average` (kind: merge, average);
- `btx_control`: the base trained on the mixture of every domain's training text with the
  experts' total compute: E × expert_steps steps of the loop that trained the experts
  (moemerge.toy.train.train_lm: same batch, lr, seq_len, weight decay), cached beside the set;
- token_routed MoEs (merge average, `router: {init: calibrate}` on each domain's training text
  named after its expert): `token_k2` the old defaults (top-2, confidence 0.8, domain targets),
  `token_k1` top-1, `token_auto` (experts_per_token: auto), `token_fit` (confidence: fit),
  `token_loss` (targets: loss), `token_auto_fit` (auto and fit);
- `seq_ppl` (seq_routed, perplexity routing) and `merged_cal` (merged_experts, calibrated), as
  run.py builds them;
- BTX post-merge training at each N of --steps: `moe+N`, the best training-free token_routed
  variant *on the chosen set* (so the held-out set gets what the chosen set would pick) + N
  steps of `finetune --train routers,experts` on the mixture, and `control+N`, the BTX control +
  N steps of `finetune --full`, same lr, batch, seq_len and data.

Each model is scored as run.py scores it (its Scorer: the last two thirds of each domain's
held-out eval text, windows of 128 tokens, the first --prompt-tokens a prompt, at most
--max-tokens tokens per domain); a row's figure is the geometric mean over domains.

Results (written after every set-seed, so a killed run keeps what it finished):
benchmarks/results/heldout.{md,json}.

    python benchmarks/quality/heldout.py [--seeds 3] [--sets chosen,held-out] [--only KEYS]
        [--steps 100,400] [--spec demo|tiny] [--expert-trains all|ffn] [--out DIR]

--expert-trains ffn makes sets whose experts train their FFNs only (as real experts of the
SmolLM2 sets do; the BTX control then trains only its FFNs too); --out writes the results
elsewhere (the committed files are the default's: experts training every weight).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]
from models import _experts, add_training_options, build, calibration, finetune, recipes  # noqa: E402,I001
from run import Scorer, split_held_out  # noqa: E402
from stamp import provenance, stamp_line  # noqa: E402

RESULTS = Path(__file__).parent.parent / "results"
SETS = {"chosen": ("code", "prose", "math", "cpp"), "held-out": ("stubs", "markdown", "tests")}
CONTROL = "btx_control"
CONTROL_FILE = "control.json"  # written last in the cached control's directory

# the token_routed variants: (label, experts_per_token, extra calibration fields)
TOKEN = {
    "token_k2": ("token_routed, old defaults (top-2, confidence 0.8, domain targets)", "2",
                 {"confidence": 0.8, "targets": "domain"}),
    "token_k1": ("token_routed, top-1", "1", {}),
    "token_auto": ("token_routed, experts_per_token: auto", "auto", {}),
    "token_fit": ("token_routed, top-2, confidence: fit", "2", {"confidence": "fit"}),
    "token_loss": ("token_routed, top-2, targets: loss", "2", {"targets": "loss"}),
    "token_auto_fit": ("token_routed, auto + confidence: fit", "auto", {"confidence": "fit"}),
}
FIXED = {  # the rows scored once per set-seed besides the token_routed variants
    "oracle": "oracle: each domain by its own expert",
    "base": "base",
    "dense_average": "dense average",
    CONTROL: "BTX control: base trained on the mixture, the experts' compute",
    "seq_ppl": "seq_routed, perplexity routing",
    "merged_cal": "merged_experts, calibrate",
}
ORDER = ["oracle", "base", "dense_average", CONTROL, *TOKEN, "seq_ppl", "merged_cal"]


def label(key: str) -> str:
    if key in TOKEN:
        return TOKEN[key][0]
    if key in FIXED:
        return FIXED[key]
    kind, n = key.split("+")
    return {"moe": f"BTX: best token_routed + {n} steps routers, experts",
            "control": f"BTX control + {n} steps full"}[kind]


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


# ---------------------------------------------------------------------------------------------
# one set at one seed: its experts, models and scores


class SetRun:
    """The toy set of `domains` at `seed` and every model made from it, in `work`."""

    def __init__(self, name: str, seed: int, args, work: Path):
        from moemerge.toy import DEMO, TINY, cached_toy_experts

        self.name, self.seed, self.args = name, seed, args
        base_spec = {"demo": DEMO, "tiny": TINY}[args.spec]
        self.spec = dataclasses.replace(base_spec, domains=SETS[name], seed=seed,
                                        expert_trains=args.expert_trains)
        start = time.perf_counter()
        self.ts = cached_toy_experts(self.spec, progress=False)
        self.toy_s = time.perf_counter() - start  # ~0 when the set was cached
        self.toy_make_s = json.loads((self.ts.root / "toyset.json").read_text())["timings"][
            "total_s"]
        self.work = work / f"{name}-s{seed}"
        self.work.mkdir(parents=True, exist_ok=True)
        # run.py's test text: the last two thirds of each domain's held-out eval text
        self.test = {d: split_held_out(p.read_text())[1] for d, p in self.ts.eval_text.items()}
        self.scorer = Scorer(self.test, args)

    # -- compute accounting (tokens = steps × batch × seq_len)

    def tokens(self, steps: int) -> int:
        return steps * self.spec.batch * self.spec.seq_len

    def compute(self) -> dict:
        e, s = len(self.spec.domains), self.spec.expert_steps
        return {"base_tokens": self.tokens(self.spec.base_steps),
                "experts_steps": e * s, "experts_tokens": self.tokens(e * s),
                "control_steps": e * s, "control_tokens": self.tokens(e * s),
                "post_tokens": {n: n * self.args.batch_size * self.args.seq_len
                                for n in self.args.steps}}

    def test_tokens(self) -> dict[str, int]:
        """Tokens of each domain's test text (the budget is min(this, --max-tokens))."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.ts.base)
        return {d: len(tok(t, add_special_tokens=False)["input_ids"]) for d, t in self.test.items()}

    # -- models

    def recipe(self, key: str) -> list[str]:
        ts, a = self.ts, self.args
        if key in TOKEN:
            _, k, fields = TOKEN[key]
            return ["kind: moe", f"seed: {self.seed}", f"base_model: {ts.base}",
                    f"experts_per_token: {k}", "merge: {method: average}",
                    *_experts(ts.experts), "router: {init: calibrate}",
                    calibration(ts, 128, a.calibration_tokens, **fields)]
        # run.py's own recipes for the rows it has too
        return recipes(ts, self.seed, a.prompt_tokens, a.calibration_tokens)[key]

    def model(self, key: str) -> Path:
        """The built model `key` (built on first use, kept in `work` for the run)."""
        out = self.work / key
        if not (out / "config.json").is_file():
            build(self.recipe(key), out)
        return out

    def control(self) -> Path:
        """The BTX control, cached beside the toy set (it depends only on the set)."""
        from moemerge.toy.cache import cached_entry

        final = self.ts.root.with_name(f"{self.ts.root.name}-btx-control")
        return cached_entry(final, CONTROL_FILE, lambda tmp: make_control(self.ts, tmp))

    def post_merge(self, moe_key: str, n: int) -> tuple[Path, Path]:
        """(MoE + n steps of routers and experts, control + n steps of everything): the same
        finetune loop, lr, batches and data for both."""
        a, lr = self.args, self.args.post_lr or self.spec.expert_lr
        moe = self.work / f"moe+{n}"
        if not (moe / "config.json").is_file():
            finetune(self.ts, self.model(moe_key), moe, ["routers", "experts"], n, lr,
                     self.seed, a)
        dense = self.work / f"control+{n}"
        if not (dense / "config.json").is_file():
            finetune(self.ts, self.control(), dense, ["all"], n, lr, self.seed, a)
        return moe, dense

    # -- scores

    def score(self, key: str) -> dict:
        """{perplexity: {domain: ppl}, own: share or None, ...} of row `key`."""
        start = time.perf_counter()
        if key == "oracle":  # each domain by its own expert: one Scorer per domain
            ppl = {d: Scorer({d: t}, self.args)(f"expert:{d}", self.ts.experts[d])[0][d]
                   for d, t in self.test.items()}
            return {"perplexity": ppl, "seconds": round(time.perf_counter() - start, 1)}
        row: dict = {}
        if key == "base":
            ref = self.ts.base
        elif key == CONTROL:  # trained on first use (cached), its time in "seconds"
            ref = self.control()
        else:
            ref = self.model(key)
            row["build_s"] = round(time.perf_counter() - start, 1)
        # Scorer reports the own-expert share for keys of routed MoEs (token_, seq_, merged_)
        ppl, own, _ = self.scorer(key, ref)
        row |= {"perplexity": ppl, "seconds": round(time.perf_counter() - start, 1)}
        if own is not None:
            row["own"] = own
        if key in TOKEN:  # the k the build chose (auto) or was given
            row["k"] = json.loads((ref / "config.json").read_text())["num_experts_per_tok"]
        return row

    def score_post(self, moe_key: str, n: int) -> dict[str, dict]:
        start = time.perf_counter()
        moe, dense = self.post_merge(moe_key, n)
        trained = round(time.perf_counter() - start, 1)
        rows = {}
        for key, ref, scorer_key in ((f"moe+{n}", moe, "token_"), (f"control+{n}", dense, "")):
            ppl, own, _ = self.scorer(scorer_key, ref)
            rows[key] = {"perplexity": ppl, "from": moe_key if key.startswith("moe") else CONTROL}
            if own is not None:
                rows[key]["own"] = own
        rows[f"moe+{n}"]["train_and_score_s"] = round(time.perf_counter() - start, 1)
        rows[f"moe+{n}"]["train_s"] = trained
        return rows


def make_control(ts, out: Path) -> None:
    """The base trained on every domain of `ts` by the loop that trained its experts (toy.train
    .train_lm: a batch's rows go round the domains, so equal shares), for as many steps as all
    the experts together, at the experts' lr, batch and seq_len; saved with the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moemerge.loading import quiet_transformers
    from moemerge.toy.experts import train_ffns_only
    from moemerge.toy.train import token_stream, train_lm

    spec, start = ts.spec, time.perf_counter()
    steps = len(spec.domains) * spec.expert_steps
    tokenizer = AutoTokenizer.from_pretrained(ts.base)
    streams = [token_stream(tokenizer, p.read_text(encoding="utf-8"))
               for p in ts.train_text.values()]
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(ts.base, dtype=torch.float32)
    if spec.expert_trains == "ffn":  # trained as the experts were: FFNs only, the rest frozen
        train_ffns_only(model)
    # a seed the experts did not use (they took seed + 1 + i): its own batches
    losses = train_lm(model, streams, steps=steps, batch=spec.batch, seq_len=spec.seq_len,
                      lr=spec.expert_lr, seed=spec.seed + 1000)
    with quiet_transformers():
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    record = {"steps": steps, "final_loss": losses[-1],
              "seconds": round(time.perf_counter() - start, 1)}
    (out / CONTROL_FILE).write_text(json.dumps(record, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# choosing row 7's MoE on the chosen set


def best_token_variant(result: dict, fallback: str) -> tuple[str, str]:
    """(key, why): the token_routed variant with the lowest mean geometric-mean perplexity on
    the chosen set over the seeds it has; `fallback` when it has none."""
    seeds = result["sets"].get("chosen", {}).get("seeds", {})
    means = {}
    for key in TOKEN:
        geo = [geomean(s["rows"][key]["perplexity"].values()) for s in seeds.values()
               if key in s["rows"]]
        if geo and len(geo) == len(seeds):
            means[key] = sum(geo) / len(geo)
    if not means:
        return fallback, "no token_routed rows on the chosen set: the fallback"
    best = min(means, key=means.get)
    return best, f"the lowest mean geo-mean on the chosen set over {len(seeds)} seed(s), " \
                 f"{means[best]:.3f}"


# ---------------------------------------------------------------------------------------------
# summaries and the markdown


def row_summary(per_seed: dict[str, dict], oracle: dict, control: dict) -> dict:
    """Over seeds: geo-mean mean / min / max, the paired mean change against the oracle and the
    control (%), per-domain means, and the wins against the control (seed × domain)."""
    seeds = sorted(per_seed)
    geo = {s: geomean(per_seed[s].values()) for s in seeds}
    out = {"geomean": sum(geo.values()) / len(geo), "min": min(geo.values()),
           "max": max(geo.values()), "seeds": len(seeds),
           "domains": {d: sum(per_seed[s][d] for s in seeds) / len(seeds)
                       for d in per_seed[seeds[0]]}}
    for name, ref in (("vs_oracle", oracle), ("vs_control", control)):
        paired = [s for s in seeds if s in ref]
        if paired:
            out[name] = 100 * sum(geo[s] / geomean(ref[s].values()) - 1
                                  for s in paired) / len(paired)
    paired = [s for s in seeds if s in control]
    if paired:
        out["wins"] = [sum(per_seed[s][d] < control[s][d] for s in paired for d in per_seed[s]),
                       sum(len(per_seed[s]) for s in paired)]
    return out


def summaries(set_result: dict) -> dict[str, dict]:
    seeds = set_result["seeds"]
    by_key: dict[str, dict] = {}
    for s, r in seeds.items():
        for key, row in r["rows"].items():
            by_key.setdefault(key, {})[s] = row["perplexity"]
    oracle, control = by_key.get("oracle", {}), by_key.get(CONTROL, {})
    keys = [k for k in ORDER if k in by_key] + [k for k in by_key if k not in ORDER]
    return {k: row_summary(by_key[k], oracle, control) for k in keys}


def _pct(value) -> str:
    return "–" if value is None else f"{value:+.1f} %"


def set_table(name: str, set_result: dict) -> list[str]:
    rows = summaries(set_result)
    domains = set_result["domains"]
    lines = [f"### {name}: {', '.join(domains)}", "",
             "| row | geo-mean ppl (min–max) | vs oracle | vs BTX control | "
             + " | ".join(domains) + " | wins vs control |",
             "|---|---:|---:|---:|" + "---:|" * len(domains) + "---:|"]
    for key, r in rows.items():
        wins = f"{r['wins'][0]}/{r['wins'][1]}" if "wins" in r and key != CONTROL else "–"
        lines.append(
            f"| {label(key)} | {r['geomean']:.3f} ({r['min']:.3f}–{r['max']:.3f}) | "
            f"{_pct(r.get('vs_oracle'))} | {_pct(r.get('vs_control')) if key != CONTROL else '–'}"
            f" | " + " | ".join(f"{r['domains'][d]:.2f}" for d in domains) + f" | {wins} |")
    return lines + [""] + post_table(set_result) + k_line(set_result)


def post_table(set_result: dict) -> list[str]:
    """The BTX post-merge comparison: MoE + N against control + N, paired per seed."""
    seeds = set_result["seeds"]
    ns = sorted({int(k.split("+")[1]) for r in seeds.values() for k in r["rows"]
                 if k.startswith("moe+")})
    if not ns:
        return []
    lines = ["| N | MoE + N (geo-mean) | control + N | MoE vs control | wins (seed × domain) |",
             "|---:|---:|---:|---:|---:|"]
    for n in ns:
        pairs = [(r["rows"][f"moe+{n}"]["perplexity"], r["rows"][f"control+{n}"]["perplexity"])
                 for r in seeds.values() if f"moe+{n}" in r["rows"]]
        m = [geomean(a.values()) for a, _ in pairs]
        c = [geomean(b.values()) for _, b in pairs]
        diff = 100 * sum(x / y - 1 for x, y in zip(m, c, strict=True)) / len(pairs)
        wins = sum(a[d] < b[d] for a, b in pairs for d in a)
        lines.append(f"| {n} | {sum(m) / len(m):.3f} | {sum(c) / len(c):.3f} | {diff:+.1f} % | "
                     f"{wins}/{sum(len(a) for a, _ in pairs)} |")
    return lines + [""]


def k_line(set_result: dict) -> list[str]:
    """What `experts_per_token: auto` chose, per seed."""
    parts = []
    for key in ("token_auto", "token_auto_fit"):
        ks = [str(r["rows"][key]["k"]) for _, r in sorted(set_result["seeds"].items())
              if key in r["rows"]]
        if ks:
            parts.append(f"`{key}` k = {', '.join(ks)}")
    return [f"k chosen by auto, per seed: {'; '.join(parts)}.", ""] if parts else []


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = ["# Held-out protocol (issue 44)", "", stamp_line(result["provenance"]), "",
             f"`{' '.join(['python benchmarks/quality/heldout.py', result['command']]).strip()}`"
             f"{'' if result['complete'] else ' (incomplete: the run was still going)'}; "
             f"runtime {result['runtime_s'] / 60:.1f} min.", "",
             f"Toy sets: the {s['spec']} size, experts training "
             f"{'their FFNs only' if s.get('expert_trains') == 'ffn' else 'every weight'}, "
             "one set per domain set and seed "
             f"({', '.join(map(str, s['seeds']))}). Scores: per-domain test perplexity (run.py's "
             f"Scorer: windows of 128 tokens, the first {s['prompt_tokens']} a prompt, at most "
             f"{s['max_tokens']} tokens per domain), a row's figure the geometric mean over "
             "domains, then mean (min–max) over seeds. vs oracle / vs BTX control: the mean over "
             "seeds of the paired change of the geo-mean. Wins: seed × domain pairs below the "
             "control.", ""]
    variant = result.get("btx_moe")
    if variant:
        lines += [f"BTX rows' MoE: `{variant['key']}` ({variant['why']}).", ""]
    for name, set_result in result["sets"].items():
        c = set_result.get("compute")
        lines += set_table(name, set_result)
        counts = [n for r in set_result["seeds"].values() for n in r["test_tokens"].values()]
        lines += [f"Test tokens per domain and seed: {min(counts):,}–{max(counts):,} available, "
                  f"at most {s['max_tokens']:,} scored.", ""]
        if c:
            post = ", ".join(f"N = {n}: {t:,}" for n, t in c["post_tokens"].items())
            lines += [f"Compute: base {c['base_tokens']:,} tokens (shared); experts "
                      f"{c['experts_steps']} steps = {c['experts_tokens']:,} tokens in all; "
                      f"BTX control {c['control_steps']} steps = {c['control_tokens']:,} "
                      f"tokens; post-merge training, each side, {post} tokens.", ""]
    return "\n".join(lines) + "\n"


def write(result: dict, out: Path = RESULTS) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "heldout.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "heldout.md").write_text(markdown(result))


# ---------------------------------------------------------------------------------------------


def ppl_line(row: dict) -> str:
    return ", ".join(f"{d} {v:.2f}" for d, v in row["perplexity"].items()) \
        + f"  (geo-mean {geomean(row['perplexity'].values()):.3f})"


def training_free(result: dict, sets: list[str], keys: list[str], args, work: Path, save) -> None:
    """Pass 1: every row but the post-merge ones, per set and seed; saved after each."""
    for name in sets:
        for seed in range(args.seeds):
            run = SetRun(name, seed, args, work)
            entry = result["sets"].setdefault(name, {"domains": list(SETS[name]), "seeds": {}})
            entry["compute"] = run.compute()
            record = entry["seeds"].setdefault(str(seed), {"rows": {}})
            record |= {"toy_make_s": run.toy_make_s, "toy_s": round(run.toy_s, 1),
                       "test_tokens": run.test_tokens()}
            for key in keys:
                record["rows"][key] = run.score(key)
                print(f"{name} s{seed} {key}: {ppl_line(record['rows'][key])} "
                      f"[{record['rows'][key]['seconds']} s]", flush=True)
            save()


def btx_moe(result: dict, sets: list[str], args) -> dict:
    """Which token_routed MoE the post-merge rows train: --btx-moe, else the best on the chosen
    set (this run's, or the saved results' when this run has no chosen set)."""
    if args.btx_moe:
        return {"key": args.btx_moe, "why": "given by --btx-moe"}
    saved = Path(args.out) / "heldout.json"
    if "chosen" not in sets and saved.is_file():
        key, why = best_token_variant(json.loads(saved.read_text()), "token_k2")
        return {"key": key, "why": why + ", in the saved results"}
    key, why = best_token_variant(result, "token_k2")
    return {"key": key, "why": why}


def post_merge(result: dict, sets: list[str], args, work: Path, save) -> None:
    """Pass 2: the BTX post-merge rows at each N, per set and seed; saved after each."""
    result["btx_moe"] = btx_moe(result, sets, args)
    for name in sets:
        for seed in range(args.seeds):
            run = SetRun(name, seed, args, work)
            entry = result["sets"].setdefault(name, {"domains": list(SETS[name]), "seeds": {}})
            rows = entry["seeds"].setdefault(str(seed), {"rows": {}})["rows"]
            for n in args.steps:
                rows |= run.score_post(result["btx_moe"]["key"], n)
                for key in (f"moe+{n}", f"control+{n}"):
                    print(f"{name} s{seed} {key}: {ppl_line(rows[key])}", flush=True)
            save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--sets", default="chosen,held-out")
    parser.add_argument("--only", default="", help="comma-separated row keys (oracle, base, "
                        f"{', '.join(ORDER[2:])}, btx for the post-merge rows)")
    parser.add_argument("--steps", default="100,400", help="post-merge training steps N")
    parser.add_argument("--post-lr", type=float, default=None,
                        help="post-merge lr (default: the experts' lr)")
    parser.add_argument("--btx-moe", default="", help="the token_routed key trained in the "
                        "post-merge rows (default: the best on the chosen set)")
    parser.add_argument("--spec", choices=("demo", "tiny"), default="demo")
    parser.add_argument("--expert-trains", choices=("all", "ffn"), default="all",
                        help="what each toy expert trains (ToySpec.expert_trains); with ffn the "
                        "BTX control trains only its FFNs too")
    parser.add_argument("--out", default=str(RESULTS), help="where heldout.{md,json} go")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=6144, help="test tokens per domain")
    parser.add_argument("--calibration-tokens", type=int, default=8192)
    add_training_options(parser)
    args = parser.parse_args()
    args.steps = [int(n) for n in args.steps.split(",") if n]
    args.exact_match = 0  # run.py's Scorer reads it: no greedy exact match here
    sets = [s for s in args.sets.split(",") if s]
    only = set(filter(None, args.only.split(",")))
    torch.set_num_threads(min(torch.get_num_threads(), 2))

    from moemerge.modeling import register
    from moemerge.toy import DEMO, TINY

    register()
    spec = {"demo": DEMO, "tiny": TINY}[args.spec]
    args.batch_size, args.seq_len = spec.batch, spec.seq_len  # post-merge: the experts' own
    clock = time.perf_counter()
    result = {"provenance": provenance(), "command": " ".join(sys.argv[1:]), "complete": False,
              "settings": vars(args) | {"seeds": list(range(args.seeds)), "sets": sets},
              "runtime_s": 0.0, "sets": {}}

    def save() -> None:
        result["runtime_s"] = time.perf_counter() - clock
        write(result, Path(args.out))

    with tempfile.TemporaryDirectory(prefix="heldout-") as tmp:
        training_free(result, sets, [k for k in ORDER if not only or k in only], args,
                      Path(tmp), save)
        if args.steps and (not only or "btx" in only):
            post_merge(result, sets, args, Path(tmp), save)
    result["complete"] = True
    save()
    print(markdown(result))
    print(f"runtime: {result['runtime_s']:.0f} s")


if __name__ == "__main__":
    main()
