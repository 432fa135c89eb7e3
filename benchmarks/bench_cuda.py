"""The CUDA paths on a GPU machine, one run: `build --device cuda` against the CPU build of the
same recipe, `finetune` on CUDA for every trainable kind against the same run on the CPU, and
every output loaded with transformers on the GPU and compared with its CPU forward.

    python benchmarks/bench_cuda.py [--device cuda] [--steps 30] [--tag NAME]

Sources: the demo toy experts (hidden 64, 2 layers; made offline and cached) and, for the
bridged kind, a random narrower Qwen2 on the same tokenizer. Every build is timed after a
warm-up build of its recipe (CUDA context, kernels); finetune rows run the same config on
`--device` and on the CPU of the same machine (tokens/s is the median after 5 warm-up steps).
`--device cpu` runs every step on the CPU both times: what CI-less machines can check of the
script itself. Results: benchmarks/results/cuda[-TAG].{json,md}.

What is compared:
- build: every output tensor of the device build against the CPU build (bitwise equal count,
  max |Δ|); the merge arithmetic is float32 on both, so differences are reduction order only.
- finetune: first-step loss on both (autocast off: same float32 maths, so equal to ~1e-6) and
  the held-out loss after the run with the device's default autocast (bf16 on CUDA).
- load: `AutoModelForCausalLM` (moemerge's own kinds with their shipped code) on the device,
  float32 logits against the CPU's, and a greedy continuation on the device.
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
from safetensors.torch import load_file
from stamp import provenance, stamp_line

RESULTS = Path(__file__).parent / "results"

# name -> (recipe lines after `experts:`, finetune parts or None, extra finetune fields)
KINDS: dict[str, tuple[list[str], list[str] | None, dict]] = {
    "mixtral, TIES, calibrated": (
        ["experts_per_token: 2", "merge: {method: ties, density: 0.5}",
         "router: {init: calibrate}"], ["routers"], {}),
    "mixtral, --full": (
        ["experts_per_token: 2", "merge: {method: average}", "router: {init: random}"],
        ["all"], {}),
    "qwen2_moe, shared expert": (
        ["experts_per_token: 2", "merge: {method: average}",
         "shared_expert: average", "router: {init: calibrate}"], ["routers"], {}),
    "dense DARE-TIES": (["kind: merge", "merge: {method: dare_ties, density: 0.5}"], None, {}),
    "seq_routed, learned": (
        ["assembly: seq_routed", "router: {kind: learned, init: random}"], ["routers"],
        {"lr": 0.3}),
    "merged_experts, CAMEx": (
        ["assembly: merged_experts", "segment_length: 32", "curvature: {kind: kronecker, "
         "rank: 1}", "mask: {kind: ties}"], ["curvature", "routers"], {"lr": 1e-2}),
    "bridged": (
        ["assembly: bridged", "router: {kind: learned, init: random}",
         "projectors: {hidden_size: 16}"], ["routers", "projectors"], {}),
}


def random_models(root: Path, tokenizer) -> dict[str, Path]:
    """A narrower Qwen2 (the bridged kind's second expert) and four Qwen2s of the demo's size
    (the Qwen2-MoE layout's base and experts: random, so only CPU against device means
    anything there)."""
    from moemerge.toy import DEMO
    from moemerge.toy.train import make_random_model

    made = {"narrow": make_random_model(
        "qwen2", root / "narrow", hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64,
        vocab=DEMO.vocab, tokenizer=tokenizer)}
    for seed in range(4):
        made[f"qwen2-{seed}"] = make_random_model(
            "qwen2", root / f"qwen2-{seed}", hidden=DEMO.hidden, layers=DEMO.layers,
            heads=DEMO.heads, kv_heads=DEMO.kv_heads, intermediate=DEMO.intermediate,
            vocab=DEMO.vocab, seed=seed, tokenizer=tokenizer)
    return made


def write_recipe(root: Path, name: str, lines: list[str], ts, models: dict[str, Path]) -> Path:
    kind_line = [x for x in lines if x.startswith("kind:")] or ["kind: moe"]
    body = [x for x in lines if not x.startswith("kind:")]
    if "assembly: bridged" in lines:
        experts, head = {"code": ts.experts["code"], "narrow": models["narrow"]}, kind_line
    elif "shared_expert: average" in lines:
        experts = {d: models[f"qwen2-{i + 1}"] for i, d in enumerate(ts.experts)}
        head = [*kind_line, f"base_model: {models['qwen2-0']}"]
    else:
        experts = ts.experts
        head = [*kind_line, f"base_model: {ts.base}"]
    key = "models" if "kind: merge" in lines else "experts"
    named = key == "experts"
    text = [*head, f"{key}:", *[f"  - {{model: {p}" + (f", name: {d}}}" if named else "}")
                                for d, p in experts.items()], *body]
    if any("calibrate" in x for x in body):
        data = ", ".join(f"{d}={p}" for d, p in ts.train_text.items())
        text.append(f"calibration: {{data: [{data}], max_tokens: 8192}}")
    path = root / f"{slug(name)}.yaml"
    path.write_text("\n".join(text) + "\n")
    return path


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out |= load_file(f)
    return out


def compare_builds(cpu: Path, dev: Path) -> dict:
    a, b = tensors(cpu), tensors(dev)
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))[:5]
    equal = sum(torch.equal(a[n], b[n]) for n in a)
    diff = max((a[n].float() - b[n].float()).abs().max().item() for n in a)
    scale = max(a[n].float().abs().max().item() for n in a)
    return {"tensors": len(a), "bitwise_equal": equal, "max_abs_diff": diff,
            "max_abs_value": scale}


def timed_build(recipe: Path, out: Path, device: str) -> float:
    from moemerge.api import build

    build(recipe, out, progress=False, device=device, force=True)  # warm-up: context, kernels
    start = time.perf_counter()
    build(recipe, out, progress=False, device=device, force=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run_finetune(model: Path, out: Path, ts, parts, extra: dict, device: str, steps: int,
                 autocast: str) -> dict:
    from moemerge.train.api import finetune
    from moemerge.train.config import make_config

    fields = {"model": str(model), "output": str(out), "train": parts,
              "data": [f"{d}={p}" for d, p in ts.train_text.items()], "seq_len": 128,
              "batch_size": 8, "lr": 1e-3, "steps": steps, "eval_fraction": 0.05,
              "device": device, "autocast": autocast, "force": True, **extra}
    start = time.perf_counter()
    result = finetune(make_config(None, fields))
    wall = time.perf_counter() - start
    train = [r for r in result.records if r.get("type") == "train"]
    mean = lambda ev: sum(v["loss"] for v in ev.values()) / len(ev)  # noqa: E731
    return {"wall_s": wall, "first_loss": train[0]["loss"], "last_loss": train[-1]["loss"],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train[5:] or train),
            "eval_before": mean(result.before), "eval_after": mean(result.after),
            "trained_tensors": len(result.trained)}


def method_parity(device: str) -> list[dict]:
    """Every merge method of the registry on the same float32 tensors (3 models and a base,
    96 × 80), on the CPU and on `device`, in row blocks of 512 entries (the path real tensors
    take: per-model thresholds over every block, then the blocked merge) and whole."""
    from moemerge.merge import dispatch
    from moemerge.merge.draws import Draws
    from moemerge.merge.registry import METHOD_SPECS

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(96, 80, generator=gen)
    models = [base + 0.05 * torch.randn(96, 80, generator=gen) for _ in range(3)]
    rows = []
    for spec in METHOD_SPECS:
        if spec.target is None:
            continue
        n = min(len(models), spec.max_models or len(models))
        params = {p.name: 0.01 for p in spec.params if p.required}  # swap_distance
        for block in (512, None):
            out = {}
            try:
                for dev in ("cpu", device):
                    out[dev] = dispatch.merge(
                        spec.name, base=base.to(dev), tensors=[m.to(dev) for m in models[:n]],
                        draws=Draws.of(1, "t"), block=block, **params).cpu()
            except RuntimeError as error:
                rows.append({"method": spec.name, "block": block, "bitwise_equal": False,
                             "max_abs_diff": float("nan"), "error": str(error)})
                continue
            rows.append({"method": spec.name, "block": block,
                         "bitwise_equal": torch.equal(out["cpu"], out[device]),
                         "max_abs_diff": (out["cpu"] - out[device]).abs().max().item()})
    return rows


def compare_load(path: Path, device: str, tokenizer_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok("def mean(values):\n    return sum(values) /", return_tensors="pt").input_ids
    logits = {}
    for dev in ("cpu", device):
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True,
                                                     dtype=torch.float32).to(dev).eval()
        with torch.no_grad():
            logits[dev] = model(ids.to(dev)).logits.float().cpu()
            if dev == device:
                gen = model.generate(ids.to(dev), max_new_tokens=12, do_sample=False)
        del model
    return {"max_abs_logit_diff": (logits["cpu"] - logits[device]).abs().max().item(),
            "greedy": tok.decode(gen[0, ids.shape[1]:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tag")
    parser.add_argument("--only", help="kind names separated by ; (default: all)")
    opts = parser.parse_args()

    from transformers import AutoTokenizer

    from moemerge.toy import DEMO, cached_toy_experts

    ts = cached_toy_experts(DEMO, progress=False)
    rows = []
    kinds = {k: v for k, v in KINDS.items()
             if not opts.only or k in opts.only.split(";")}
    methods = method_parity(opts.device)
    print(json.dumps(methods, indent=1), flush=True)
    with tempfile.TemporaryDirectory(prefix="moemerge-cuda-") as tmp:
        root = Path(tmp)
        models = random_models(root, AutoTokenizer.from_pretrained(ts.base))
        for name, (lines, parts, extra) in kinds.items():
            print(f"== {name}", flush=True)
            recipe = write_recipe(root, name, lines, ts, models)
            row: dict = {"kind": name}
            cpu_out, dev_out = root / f"{slug(name)}-cpu", root / f"{slug(name)}-dev"
            row["build_cpu_s"] = timed_build(recipe, cpu_out, "cpu")
            row["build_dev_s"] = timed_build(recipe, dev_out, opts.device)
            row["build"] = compare_builds(cpu_out, dev_out)
            row["load"] = compare_load(dev_out, opts.device, ts.base)
            if parts is not None:
                row["finetune_dev"] = run_finetune(dev_out, root / "ft-dev", ts, parts, extra,
                                                   opts.device, opts.steps, "auto")
                row["finetune_cpu"] = run_finetune(dev_out, root / "ft-cpu", ts, parts, extra,
                                                   "cpu", opts.steps, "auto")
                # the same float32 maths on both: the first step's loss must agree
                row["first_loss_fp32"] = {
                    dev: run_finetune(dev_out, root / f"ft1-{dev}", ts, parts, extra, dev, 1,
                                      "off")["first_loss"] for dev in ("cpu", opts.device)}
                row["load_trained"] = compare_load(root / "ft-dev", opts.device, ts.base)
            print(json.dumps(row, indent=1), flush=True)
            rows.append(row)
    write_results(rows, methods, opts, provenance())


def write_results(rows: list[dict], methods: list[dict], opts, record: dict) -> None:
    name = f"cuda-{opts.tag}" if opts.tag else "cuda"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(
        {"provenance": record, "device": opts.device, "steps": opts.steps, "rows": rows,
         "methods": methods},
        indent=1) + "\n")
    md = [f"# CUDA paths: build --device {opts.device}, finetune, load (demo toy experts)", "",
          stamp_line(record), "",
          f"Builds timed after a warm-up build; finetune {opts.steps} steps, batch 8 × 128 "
          "tokens, autocast auto (bf16 on CUDA); CPU columns on the same machine.", "",
          "| kind | build cpu / device s | bitwise equal | max abs Δ (of max) | load: max abs "
          "Δlogit | finetune tok/s cpu / device | first-step loss fp32 cpu / device | held-out "
          "loss before → after (device) | trained model Δlogit |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, ft, fc = r["build"], r.get("finetune_dev"), r.get("finetune_cpu")
        first = r.get("first_loss_fp32")
        md.append("| " + " | ".join([
            r["kind"], f"{r['build_cpu_s']:.2f} / {r['build_dev_s']:.2f}",
            f"{b['bitwise_equal']}/{b['tensors']}",
            f"{b['max_abs_diff']:.2e} ({b['max_abs_value']:.2g})",
            f"{r['load']['max_abs_logit_diff']:.2e}",
            f"{fc['tokens_per_s']:,.0f} / {ft['tokens_per_s']:,.0f}" if ft else "–",
            " / ".join(f"{v:.6f}" for v in first.values()) if first else "–",
            f"{ft['eval_before']:.4f} → {ft['eval_after']:.4f}" if ft else "–",
            f"{r['load_trained']['max_abs_logit_diff']:.2e}" if ft else "–"]) + " |")
    md += ["", "Greedy continuations on the device of `def mean(values):⏎    return "
           "sum(values) /`:", ""]
    md += [f"- {r['kind']}: {r['load']['greedy']!r}" for r in rows]
    md += ["", f"Every merge method, 3 models + base (96 × 80, float32), CPU against "
           f"{opts.device}, in row blocks of 512 entries / whole:", "",
           "| method | bitwise equal (blocks / whole) | max abs Δ (blocks / whole) |",
           "|---|---|---|"]
    for blocked, whole in zip(methods[::2], methods[1::2], strict=True):
        md.append(f"| {blocked['method']} | {blocked['bitwise_equal']} / "
                  f"{whole['bitwise_equal']} | {blocked['max_abs_diff']:.1e} / "
                  f"{whole['max_abs_diff']:.1e} |")
    md += ["", "At a real shape (Llama-3.2-1B, 4 of its 16 layers, base + 4 experts, bf16), "
           "`build --device` against the CPU of the same machine: "
           "`python benchmarks/bench_scale.py --shape llama-3.2-1b --layers 4 --runs "
           "dense:ties,dense:dare_ties,moe:average --no-select --device cuda|cpu --tag "
           "gpu-cuda|gpu-cpu` (results/scale-gpu-cuda.md, results/scale-gpu-cpu.md)."]
    (RESULTS / f"{name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
