"""`moemerge finetune`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from moemerge.cli.app import app, err, out, reports_errors

Opt = typer.Option


@app.command()
@reports_errors
def finetune(
    model: Annotated[
        Optional[str],  # noqa: UP045 - typer needs Optional on 3.10
        typer.Argument(help="MoE model directory (e.g. made by `moemerge build`).",
                       show_default=False, metavar="MODEL_DIR"),
    ] = None,
    output: Annotated[
        Optional[str],  # noqa: UP045
        typer.Argument(help="Output model directory (written atomically).", show_default=False,
                       metavar="OUT"),
    ] = None,
    config: Annotated[Optional[Path], Opt(  # noqa: UP045
        help="YAML file with the same fields (options given here override it).")] = None,
    data: Annotated[Optional[list[str]], Opt(  # noqa: UP045
        help="Text/JSONL file, directory (domain = file stem) or name=path; repeat.")] = None,
    router_only: Annotated[bool, Opt("--router-only", help="Train the routers only "
                                     "(the default).")] = False,
    train: Annotated[Optional[str], Opt(  # noqa: UP045
        help="What to train: 'routers', 'projectors' or 'routers,projectors'.")] = None,
    full: Annotated[bool, Opt("--full", help="Train every parameter.")] = False,
    seq_len: Annotated[Optional[int], Opt(help="Tokens per block [256].")] = None,  # noqa: UP045
    eval_fraction: Annotated[Optional[float], Opt(  # noqa: UP045
        help="Held-out share of each domain's blocks [0.1].")] = None,
    text_field: Annotated[Optional[str], Opt(help="JSONL text field [text].")] = None,  # noqa: UP045
    batch_size: Annotated[Optional[int], Opt(  # noqa: UP045
        help="Blocks per optimizer step over all processes [8].")] = None,
    grad_accum: Annotated[Optional[int], Opt(help="Micro-batches per step [1].")] = None,  # noqa: UP045
    steps: Annotated[Optional[int], Opt(help="Optimizer steps [one epoch].")] = None,  # noqa: UP045
    epochs: Annotated[Optional[float], Opt(help="Passes over the data, if no --steps [1].")] = None,  # noqa: UP045,E501
    lr: Annotated[Optional[float], Opt(help="Peak learning rate [1e-3].")] = None,  # noqa: UP045
    weight_decay: Annotated[Optional[float], Opt(help="AdamW weight decay [0].")] = None,  # noqa: UP045
    schedule: Annotated[Optional[str], Opt(help="cosine | linear | constant [cosine].")] = None,  # noqa: UP045
    warmup_steps: Annotated[Optional[int], Opt(help="Warm-up steps [10% of steps].")] = None,  # noqa: UP045
    max_grad_norm: Annotated[Optional[float], Opt(help="Clip norm, 0 = off [1.0].")] = None,  # noqa: UP045
    aux_loss_coef: Annotated[Optional[float], Opt(  # noqa: UP045
        help="Load-balancing loss coefficient [0.04 / top-k if upcycled, else 0].")] = None,
    eval_every: Annotated[Optional[int], Opt(help="Evaluate every N steps [0: end].")] = None,  # noqa: UP045
    seed: Annotated[Optional[int], Opt(help="Seed of data order and RNG [0].")] = None,  # noqa: UP045
    device: Annotated[Optional[str], Opt(help="auto | cpu | cuda [auto].")] = None,  # noqa: UP045
    autocast: Annotated[Optional[str], Opt(  # noqa: UP045
        help="Mixed-precision forwards: auto (bf16 on CUDA, none on the CPU) | bf16 | off "
        "[auto].")] = None,
    save_every: Annotated[Optional[int], Opt(  # noqa: UP045
        help="Checkpoint into OUT.checkpoints/ every N steps [0: never].")] = None,
    keep_checkpoints: Annotated[Optional[int], Opt(help="Checkpoints kept [2].")] = None,  # noqa: UP045
    resume: Annotated[bool, Opt("--resume", help="Continue from the latest checkpoint.")] = False,
    force: Annotated[bool, Opt("--force", help="Replace OUT if it exists.")] = False,
    fsdp: Annotated[bool, Opt("--fsdp", help="Under torchrun: shard parameters, gradients "
                              "and optimizer states over the processes (FSDP), not DDP.")] = False,
    gradient_checkpointing: Annotated[bool, Opt(
        "--gradient-checkpointing", help="Recompute activations in the backward pass: lower "
        "peak memory, about a third more time per step.")] = False,
    trust_remote_code: Annotated[bool, Opt("--trust-remote-code")] = False,
    quiet: Annotated[bool, Opt("--quiet", "-q", help="No tables or progress bar.")] = False,
) -> None:
    """Fine-tune an MoE's routers (default), or everything (--full), on text; write OUT.

    Runs on one process or many: `torchrun --nproc-per-node N -m moemerge finetune ...`."""
    from moemerge.errors import RecipeError
    from moemerge.train.api import finetune as run_finetune
    from moemerge.train.config import make_config

    chosen = [flag for flag, on in (("--router-only", router_only), ("--full", full),
                                    ("--train", train is not None)) if on]
    if len(chosen) > 1:
        raise RecipeError(f"{' and '.join(chosen)}: give only one of --router-only, --train, "
                          "--full")
    parts = (["routers"] if router_only else ["all"] if full
             else [p.strip() for p in train.split(",")] if train is not None else None)
    options = {k: v for k, v in locals().items() if k in _FINETUNE_FIELDS}
    options |= {"train": parts, "data": data or None}
    for flag in ("resume", "force", "fsdp", "gradient_checkpointing", "trust_remote_code"):
        options[flag] = True if options[flag] else None
    cfg = make_config(config, options)
    result = run_finetune(cfg, console=None if quiet else err, config_file=config)
    after = sum(d["ppl"] for d in result.after.values()) / len(result.after)
    before = sum(d["ppl"] for d in result.before.values()) / len(result.before)
    out.print(f"[green]finetuned[/] {cfg.output} ({result.steps} steps; mean held-out perplexity "
              f"{before:.2f} → {after:.2f})")


_FINETUNE_FIELDS = {
    "model", "output", "seq_len", "eval_fraction", "text_field", "batch_size", "grad_accum",
    "steps", "epochs", "lr", "weight_decay", "schedule", "warmup_steps", "max_grad_norm",
    "aux_loss_coef", "eval_every", "seed", "device", "autocast", "save_every", "keep_checkpoints",
    "resume", "force", "fsdp", "gradient_checkpointing", "trust_remote_code",
}
