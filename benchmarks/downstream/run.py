"""Do llama.cpp and transformers compute the same model from a moemerge output?

For every token-routed layout (Mixtral, Qwen2-MoE, Qwen3-MoE) and its edge cases, this builds
tiny dense sources with a real tokenizer (real_tokenizers.py), perturbed copies of them as
distinct experts, the MoE with moemerge, converts the MoE and its dense base with llama.cpp's
own `convert_hf_to_gguf.py` to f32 and bf16 GGUF, and compares llama.cpp's per-token logits
with transformers' (float32) on the same token ids of real text: max |Δlogit| and perplexity.
llama.cpp comes from the `llama-cpp-python` sdist, built for this CPU (llamacpp.py).

    python benchmarks/downstream/run.py [--cache /tmp/moemerge-downstream] [--cases a,b]
    python benchmarks/downstream/run.py --real   # a MoE of the real SmolLM2 experts, + q8_0

Everything but the results is cached under --cache, each case and file once, so a run may be
split (`--cases`) and resumed; results per case go to CACHE/results/NAME.json (with the
provenance of the run that measured it), and the table of every case found there to
benchmarks/results/downstream.md (the writer's provenance, and each case's commit and day).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import llamacpp
import real_tokenizers
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stamp import parts_line, provenance, stamp_line  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
INIT_STD = 0.2  # 10× transformers' default, so logits spread (std ≈ 1) and routing is not flat
EXPERT_NOISE = 0.5  # relative: expert = base + 0.5 · std(tensor) · N(0, 1), every tensor
TOKENS, CTX = 1024, 128
F32_LOGIT, F32_PPL, BF16_PPL = 1e-4, 1e-5, 1e-3  # the targets


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # llama | qwen2 | qwen3
    experts: int = 0  # 0: the dense control
    k: int = 2
    include_base: bool = False
    tied: bool = False
    dtype: str = "float32"  # the output's dtype
    shared: str = "none"  # Qwen2-MoE's shared_expert
    note: str = ""
    real: bool = False  # sources: the real SmolLM2 expert set (trained weights), not random

    @property
    def outtypes(self) -> tuple[str, ...]:
        # q8_0 only where weights are trained: on random ones its error says nothing of users'
        return ("f32", "bf16", "q8_0") if self.real else ("f32", "bf16")

    @property
    def tokenizer(self) -> str:
        # Qwen2-MoE / Qwen3-MoE's converter class reads BPE vocabularies only
        return "spm" if self.family == "llama" else "qwen"

    @property
    def base_key(self) -> str:
        return f"{self.family}{'-tied' if self.tied else ''}"


CASES = [
    Case("mixtral-3x-k2", "llama", 3, 2),
    Case("mixtral-4x-k1-base", "llama", 3, 1, include_base=True),
    Case("mixtral-2x-k2-tied", "llama", 2, 2, tied=True),
    Case("mixtral-3x-k2-bf16", "llama", 3, 2, dtype="bfloat16"),
    Case("qwen2moe-3x-k2", "qwen2", 3, 2,
         note="k < N: llama.cpp's qwen2moe skips norm_topk_prob (build warns)"),
    Case("qwen2moe-3x-k3", "qwen2", 3, 3),
    Case("qwen2moe-4x-k4-base-shared", "qwen2", 3, 4, include_base=True, shared="base"),
    Case("qwen2moe-3x-k3-bf16", "qwen2", 3, 3, dtype="bfloat16"),
    Case("qwen3moe-3x-k2", "qwen3", 3, 2),
    Case("qwen3moe-5x-k1-tied", "qwen3", 5, 1, tied=True),
    Case("qwen3moe-4x-k2-base-bf16", "qwen3", 3, 2, include_base=True, dtype="bfloat16"),
]
# run with --real: the real set (`moemerge toy DIR --preset smollm2-experts`, ~40 min to make)
REAL_CASES = [
    Case("real-smollm2-mixtral-4x-k2", "llama", 4, 2, tied=True, dtype="bfloat16", real=True,
         note="SmolLM2-135M and its 4 experts (code, prose, math, C++); calibrated router"),
]


def save_model(model, out: Path, tok_dir: Path, dtype: torch.dtype) -> Path:
    from moemerge.toy.train import quiet_transformers

    with quiet_transformers():
        model.to(dtype).save_pretrained(out)
    for f in tok_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def dense_sources(cache: Path, case: Case) -> tuple[Path, list[Path]]:
    """(base, experts): a random dense model of the case's family with the real tokenizer's
    vocabulary, and perturbed copies of it (every tensor, so attention merges too)."""
    from moemerge.toy.train import init_model, model_config

    root = cache / "sources" / f"{case.base_key}-{case.dtype}"
    tok_dir = cache / f"tok-{case.tokenizer}"
    vocab = (real_tokenizers.write_spm if case.tokenizer == "spm"
             else real_tokenizers.write_qwen)(cache, tok_dir)
    dtype = getattr(torch, case.dtype)
    base = root / "base"
    if not (base / "config.json").is_file():
        config = model_config(case.family, hidden=HIDDEN, layers=LAYERS, heads=HEADS,
                              kv_heads=KV_HEADS, intermediate=FFN, vocab=vocab,
                              tie_word_embeddings=case.tied)
        config.initializer_range = INIT_STD
        config.bos_token_id, config.eos_token_id, config.pad_token_id = None, None, None
        model = init_model(config, seed=0)
        save_model(model, base, tok_dir, dtype)
    experts = []
    for e in range(case.experts):
        expert = root / f"expert{e}"
        experts.append(expert)
        if (expert / "config.json").is_file():
            continue
        from transformers import AutoModelForCausalLM

        from moemerge.toy.train import quiet_transformers

        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        gen = torch.Generator().manual_seed(100 + e)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(EXPERT_NOISE * p.std() * torch.randn(p.shape, generator=gen))
        save_model(model, expert, tok_dir, dtype)
    return base, experts


def real_set():
    """The real expert set (cached; made on first use)."""
    from moemerge.toy.real_experts import REAL, cached_real_experts

    return cached_real_experts(REAL)


def sources(cache: Path, case: Case) -> tuple[Path, list[Path]]:
    if not case.real:
        return dense_sources(cache, case)
    ts = real_set()
    return ts.base, list(ts.experts.values())


def router_lines(case: Case) -> list[str]:
    """Random routers at std 1 route tokens to different experts on random sources; the real
    set's router is calibrated on its experts' training text, as a user would build it."""
    if not case.real:
        return ["router: {init: random, std: 1.0}"]
    ts = real_set()
    data = ", ".join(f"{d}={p}" for d, p in ts.train_text.items())
    return ["router: {init: calibrate}",
            f"calibration: {{data: [{data}], max_tokens: 1024, seq_len: 128}}"]


def build_moe(cache: Path, case: Case, base: Path, experts: list[Path]) -> Path:
    from moemerge.api import build

    out = cache / "moe" / case.name
    if (out / "config.json").is_file():
        return out
    recipe = cache / "moe" / f"{case.name}.yaml"
    recipe.parent.mkdir(parents=True, exist_ok=True)
    lines = ["kind: moe", "assembly: token_routed", f"base_model: {base}",
             f"experts: [{', '.join(str(e) for e in experts[:case.experts])}]",
             f"experts_per_token: {case.k}",
             f"include_base_expert: {str(case.include_base).lower()}",
             *router_lines(case),
             f"output: {{dtype: {case.dtype}}}", "seed: 0"]
    if case.family == "qwen2":
        lines.append(f"shared_expert: {case.shared}")
    recipe.write_text("\n".join(lines) + "\n")
    build(recipe, out, progress=False, warn=lambda msg: print(f"  build warns: {msg}"))
    return out


def windows(cache: Path, case: Case) -> list[list[int]]:
    from moemerge.toy.corpora import domain_text

    if case.real:  # the real tokenizer on each domain's held-out text, as many windows each
        from transformers import AutoTokenizer

        ts = real_set()
        tokenizer = AutoTokenizer.from_pretrained(ts.base)
        per = TOKENS // CTX // len(ts.eval_text)
        return [tokenizer(p.read_text(), add_special_tokens=False)["input_ids"][i:i + CTX]
                for p in ts.eval_text.values() for i in range(0, per * CTX, CTX)]
    ids = real_tokenizers.encoder(case.tokenizer, cache / f"tok-{case.tokenizer}")(
        domain_text("prose", 8 * TOKENS, seed=0, split="eval"))
    if len(ids) < TOKENS:
        raise RuntimeError(f"only {len(ids)} tokens of text, need {TOKENS}")
    return [ids[i:i + CTX] for i in range(0, TOKENS, CTX)]


def transformers_logits(model_dir: Path, wins: list[list[int]], dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    from moemerge.toy.train import quiet_transformers

    config = json.loads((model_dir / "config.json").read_text())
    moe = "num_local_experts" in config or "num_experts" in config
    # transformers 5's grouped_mm experts take no float64; its per-expert loop does
    extra = {"experts_implementation": "eager"} if moe and dtype == torch.float64 else {}
    with quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **extra).eval()
    with torch.no_grad():
        for w in wins:
            yield model(input_ids=torch.tensor([w])).logits[0].double()


def nll(logits: torch.Tensor, window: list[int]) -> float:
    """Summed negative log-likelihood of window[1:], float64."""
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return -logp.gather(1, torch.tensor(window[1:])[:, None]).sum().item()


def compare(cache: Path, model_dir: Path, gguf: Path, wins: list[list[int]]) -> dict:
    """llama.cpp against transformers in float32 (the reference the targets are for), and
    transformers float32 against float64: the float32 rounding floor of this model."""
    n = sum(len(w) - 1 for w in wins)
    max_diff, floor, nll_t, nll_l, logit_sq, logit_max = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    same_argmax = 0
    for w, ref, exact, got in zip(wins, transformers_logits(model_dir, wins),
                                  transformers_logits(model_dir, wins, torch.float64),
                                  llamacpp.logits(gguf, wins), strict=True):
        got = torch.from_numpy(got).double()
        max_diff = max(max_diff, (got - ref).abs().max().item())
        if not torch.isfinite(got).all():
            max_diff = math.nan
        floor = max(floor, (ref - exact).abs().max().item())
        same_argmax += (got.argmax(-1) == ref.argmax(-1))[:-1].sum().item()
        nll_t, nll_l = nll_t + nll(ref, w), nll_l + nll(got, w)
        logit_sq += ref.std(dim=-1).square().mean().item()
        logit_max = max(logit_max, ref.abs().max().item())
    ppl_t, ppl_l = math.exp(nll_t / n), math.exp(nll_l / n)
    return {"max_abs_logit": max_diff, "ppl_transformers": ppl_t, "ppl_llama_cpp": ppl_l,
            "ppl_rel": abs(ppl_l - ppl_t) / ppl_t, "logit_std": math.sqrt(logit_sq / len(wins)),
            "logit_max": logit_max, "f32_vs_f64": floor, "argmax_agreement": same_argmax / n}


def run_case(cache: Path, case: Case) -> dict:
    out = cache / "results" / f"{case.name}.json"
    if out.is_file():
        return json.loads(out.read_text())
    t0 = time.time()
    base, experts = sources(cache, case)
    moe = build_moe(cache, case, base, experts)
    wins = windows(cache, case)
    row = {"case": case.name, "arch": json.loads((moe / "config.json").read_text())
           ["architectures"][0], "dtype": case.dtype, "note": case.note, "tokens": len(wins) * CTX}
    for label, model in (("moe", moe), ("dense", base)):
        for outtype in case.outtypes:
            gguf_dir = cache / "gguf"
            gguf_dir.mkdir(exist_ok=True)
            stem = (case.name if label == "moe" else
                    f"dense-{'real-' if case.real else ''}{case.base_key}-{case.dtype}")
            gguf = llamacpp.convert(cache, model, gguf_dir / f"{stem}-{outtype}.gguf", outtype)
            row[f"{label}_{outtype}"] = compare(cache, model, gguf, wins)
            print(f"  {label} {outtype}: {row[f'{label}_{outtype}']}")
    row["seconds"] = round(time.time() - t0, 1)
    row["provenance"] = provenance()
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(row, indent=1))
    return row


def _cell(r: dict, bf16: bool) -> str:
    logit, ppl = r["max_abs_logit"], r["ppl_rel"]
    if math.isnan(logit) or math.isnan(ppl):
        return "**NaN**"
    ok = ppl <= BF16_PPL if bf16 else (logit <= F32_LOGIT and ppl <= F32_PPL)
    return f"{logit:.1e} / {ppl:.1e}" + ("" if ok else " ✗")


def table(rows: list[dict], llama_cpp: str) -> str:
    lines = ["# llama.cpp vs transformers on moemerge outputs", "", stamp_line(provenance()), "",
             parts_line({r["case"]: r.get("provenance") for r in rows}, "cases"), "",
             "Written by `benchmarks/downstream/run.py` ([README](../downstream/README.md)). "
             "Each GGUF cell: max |Δlogit| / relative perplexity difference, llama.cpp "
             f"(vendored in the {llama_cpp} sdist, built for CPU; f32 KV cache) against "
             f"transformers (float32) on the same {TOKENS} tokens of real text (CPython "
             f"docstrings), {TOKENS // CTX} windows of {CTX}. ✗: outside the target (f32 GGUF: "
             f"max |Δlogit| ≤ {F32_LOGIT:g} and perplexity equal to {F32_PPL:g} relative; "
             f"bf16 GGUF: perplexity within {BF16_PPL:g} relative). Dense control: the MoE's "
             "base model, converted and compared the same way. f32 floor: max |Δlogit| "
             "between transformers in float32 and in float64 on the same weights, the "
             "rounding noise of float32 itself for this model (MoE / dense).", "",
             "| case | layout | output dtype | MoE f32 GGUF | MoE bf16 GGUF | dense f32 GGUF "
             "| dense bf16 GGUF | f32 floor | max \\|logit\\| / std | perplexity "
             "(transformers) | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        moe, dense = r["moe_f32"], r["dense_f32"]
        floor = (f"{moe['f32_vs_f64']:.1e} / {dense['f32_vs_f64']:.1e}"
                 if "f32_vs_f64" in moe else "–")
        scale = f"{moe.get('logit_max', math.nan):.1f} / {moe['logit_std']:.2f}"
        lines.append(
            f"| {r['case']} | {r['arch']} | {r['dtype']} | {_cell(moe, False)} | "
            f"{_cell(r['moe_bf16'], True)} | {_cell(dense, False)} | "
            f"{_cell(r['dense_bf16'], True)} | {floor} | {scale} | "
            f"{moe['ppl_transformers']:.4g} | {r['note']} |")
    return "\n".join(lines) + "\n"


def real_table(rows: list[dict], llama_cpp: str) -> str:
    """One line per model and GGUF type of the --real cases."""
    targets = {"f32": F32_PPL, "bf16": BF16_PPL}
    lines = ["# llama.cpp vs transformers on a MoE of real pretrained experts", "",
             stamp_line(provenance()), "",
             "Written by `benchmarks/downstream/run.py --real` ([README](../downstream/README.md))."
             f" llama.cpp (vendored in the {llama_cpp} sdist, built for CPU; f32 KV cache) "
             f"against transformers (float32) on the same {TOKENS} tokens: the real set's "
             f"held-out text, {TOKENS // CTX // 4} windows of {CTX} per domain (code, prose, "
             "math, C++). Targets: relative perplexity difference ≤ "
             f"{F32_PPL:g} for f32 GGUF, ≤ {BF16_PPL:g} for bf16; q8_0 has none (8-bit "
             "weights). Argmax agreement: the share of positions where both pick the same next "
             "token.", "",
             "| case | model | GGUF | max \\|Δlogit\\| | perplexity transformers | perplexity "
             "llama.cpp | relative Δ | target | argmax agreement |",
             "|---|---|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        for label in ("moe", "dense"):
            for outtype in ("f32", "bf16", "q8_0"):
                c = r[f"{label}_{outtype}"]
                target = targets.get(outtype)
                verdict = "–" if target is None else (
                    f"≤ {target:g} " + ("✓" if c["ppl_rel"] <= target else "✗"))
                lines.append(
                    f"| {r['case']} | {'MoE' if label == 'moe' else 'dense base'} | {outtype} | "
                    f"{c['max_abs_logit']:.2e} | {c['ppl_transformers']:.4f} | "
                    f"{c['ppl_llama_cpp']:.4f} | {c['ppl_rel']:.1e} | {verdict} | "
                    f"{c['argmax_agreement']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=Path, default=Path("/tmp/moemerge-downstream"))
    parser.add_argument("--cases", default="", help="comma-separated case names (default all)")
    parser.add_argument("--real", action="store_true", help="the cases built from the real "
                        "SmolLM2 expert set instead (results/downstream-real.md)")
    opts = parser.parse_args()
    torch.set_num_threads(2)
    cache = opts.cache.resolve()
    llamacpp.setup(cache)
    cases = REAL_CASES if opts.real else CASES
    wanted = set(filter(None, opts.cases.split(",")))
    unknown = wanted - {c.name for c in cases}
    if unknown:
        sys.exit(f"unknown case(s) {sorted(unknown)}; known: {[c.name for c in cases]}")
    for case in cases:
        if not wanted or case.name in wanted:
            print(case.name, flush=True)
            run_case(cache, case)
    rows = [json.loads((cache / "results" / f"{c.name}.json").read_text()) for c in cases
            if (cache / "results" / f"{c.name}.json").is_file()]
    RESULTS.mkdir(exist_ok=True)
    name = llamacpp.sdist_dir(cache).name.replace("_", "-")
    text = real_table(rows, name) if opts.real else table(rows, name)
    (RESULTS / ("downstream-real.md" if opts.real else "downstream.md")).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
