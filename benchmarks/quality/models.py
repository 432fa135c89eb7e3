"""Recipes, builds, fine-tunes and the dense control of the quality benchmark (run.py)."""

from __future__ import annotations

from pathlib import Path

import torch

TIES = "{method: ties, density: 0.7, lambda: 0.5}"
DARE = "{method: dare_ties, density: 0.7, lambda: 0.5}"


def _experts(paths: dict[str, Path]) -> list[str]:
    return ["experts:", *(f"  - {{model: {p}, name: {d}}}" for d, p in paths.items())]


def calibration(ts, seq_len: int) -> str:
    """router.init: calibrate's block: each domain's training text, named after its expert."""
    data = ", ".join(f"{d}={p}" for d, p in ts.train_text.items())
    return f"calibration: {{data: [{data}], max_tokens: 8192, seq_len: {seq_len}}}"


def recipes(ts, narrow: dict[str, Path], seed: int, prompt: int = 32) -> dict[str, list[str]]:
    """{key: recipe lines} of every model built from the toy set `ts`; `narrow` is the bridged
    experts (some of another width). Sequence routers are calibrated on windows as long as
    the `prompt` they route on."""
    base, moe = f"base_model: {ts.base}", ["kind: moe", f"seed: {seed}"]
    token = [*moe, base, *_experts(ts.experts), "experts_per_token: 2", "router: {init: random}"]
    seq = [*moe, "assembly: seq_routed", base, *_experts(ts.experts),
           "per_expert: [embed, lm_head]"]
    merged = [*moe, "assembly: merged_experts", base, *_experts(ts.experts),
              "segment_length: 16"]
    models = ", ".join(map(str, ts.experts.values()))
    dense = ["kind: merge", f"seed: {seed}", base, f"models: [{models}]"]
    return {
        "dense_ties": [*dense, f"merge: {TIES}"],
        "dense_dare": [*dense, f"merge: {DARE}"],
        "token_avg": [*token, "merge: {method: average}"],
        "token_ties": [*token, f"merge: {TIES}"],
        "token_dare": [*token, f"merge: {DARE}"],
        "seq_ppl": [*seq, "router: {kind: perplexity}"],
        "seq_tv": [*seq, "router: {kind: task_vector}"],
        "bridged": [*moe, "assembly: bridged", *_experts(narrow),
                    "projectors: {init: lstsq}"],
        "token_cal": [*token[:-1], "router: {init: calibrate}", calibration(ts, 128),
                      "merge: {method: average}"],
        "seq_cal": [*seq, "router: {kind: learned, init: calibrate}", calibration(ts, prompt)],
        "bridged_cal": [*moe, "assembly: bridged", *_experts(narrow),
                        "projectors: {init: lstsq}", "router: {kind: learned, init: calibrate}",
                        calibration(ts, prompt)],
        "merged_cal": [*merged, "curvature: {kind: none}", "router: {init: calibrate}",
                       calibration(ts, 128)],
        "merged_none": [*merged, "curvature: {kind: none}"],
        "merged_ca": [*merged, "curvature: {kind: kronecker}"],
    }


def build(lines: list[str], out: Path) -> Path:
    from moemerge.api import build as build_model

    out.parent.mkdir(parents=True, exist_ok=True)
    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text("\n".join(lines) + "\n")
    build_model(recipe, out, progress=False)
    return out


def _config(ts, model: Path, out: Path, parts: list[str], steps: int, lr: float, seed: int,
            args, **extra):
    from moemerge.train.config import make_config

    return make_config(None, extra | {
        "model": str(model), "output": str(out), "train": parts, "steps": steps, "lr": lr,
        "data": [f"{d}={p}" for d, p in ts.train_text.items()], "seq_len": args.seq_len,
        "batch_size": args.batch_size, "eval_fraction": args.eval_fraction, "device": "cpu",
        "seed": seed})


def finetune(ts, model: Path, out: Path, parts: list[str], steps: int, lr: float, seed: int,
             args, **extra) -> Path:
    """`extra`: more finetune config fields (e.g. aux_loss_coef)."""
    from moemerge.train.api import finetune as run_finetune

    run_finetune(_config(ts, model, out, parts, steps, lr, seed, args, **extra))
    return out


def train_dense(ts, model: Path, steps: int, lr: float, seed: int, args):
    """The compute-matched dense control, trained by moemerge's own training step (finetune
    refuses dense models): the same blocks, batches (a pure function of seed and step), AdamW,
    warm-up + cosine schedule, clipping and loss as `finetune --full` with these settings.
    Returns (model, tokenizer) in memory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moemerge.data import read_domains
    from moemerge.loading import quiet_transformers
    from moemerge.train import distributed, loop
    from moemerge.train.data import make_blocks

    cfg = _config(ts, model, model.parent / "unused", ["all"], steps, lr, seed, args)
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(model)
        net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    blocks = make_blocks(read_domains(cfg.data, text_field=cfg.text_field), tokenizer, cfg.seq_len,
                         cfg.eval_fraction)
    ctx = distributed.setup("cpu")
    trainable = [p for p in net.parameters() if p.requires_grad]
    torch.manual_seed(cfg.seed)
    optim = loop.make_optim(trainable, cfg, steps)
    net.train()
    for step in range(steps):
        loop.train_step(net, optim, blocks, step, cfg, ctx, trainable)
    return net.eval(), tokenizer


def same_vocabulary(a: Path, b: Path) -> bool:
    from transformers import AutoTokenizer

    vocab = [AutoTokenizer.from_pretrained(p).get_vocab() for p in (a, b)]
    return vocab[0] == vocab[1]
