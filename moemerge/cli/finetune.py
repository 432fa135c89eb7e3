"""`moemerge finetune`: every TrainConfig field is an option, its help from the field."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from moemerge.cli.app import app, defaults, described, err, out, reports_errors
from moemerge.train.config import TrainConfig, field_default

# options that are not TrainConfig fields (--router-only / --full / --train make `train`)
NOT_FIELDS = {"config", "router_only", "full", "quiet"}


D = defaults(TrainConfig)


def Field(name: str, *decls: str):  # noqa: N802 - reads as the option it declares
    """The typer option of TrainConfig field `name`, described by the field."""
    return described(TrainConfig, name, *decls, show_default=field_default(name) is not None)


def _typed(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


@app.command()
@reports_errors
def finetune(
    ctx: typer.Context,
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
    config: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="YAML file with these fields (options given here override it).")] = None,
    data: Annotated[Optional[list[str]], Field("data")] = None,  # noqa: UP045
    router_only: Annotated[bool, typer.Option(
        "--router-only", help="Train the routers only (the default).")] = False,
    train: Annotated[Optional[str], Field("train")] = None,  # noqa: UP045
    full: Annotated[bool, typer.Option("--full", help="Train every parameter.")] = False,
    seq_len: Annotated[int, Field("seq_len")] = D["seq_len"],
    eval_fraction: Annotated[float, Field("eval_fraction")] = D["eval_fraction"],
    text_field: Annotated[str, Field("text_field")] = D["text_field"],
    label_field: Annotated[str, Field("label_field")] = D["label_field"],
    batch_size: Annotated[int, Field("batch_size")] = D["batch_size"],
    grad_accum: Annotated[int, Field("grad_accum")] = D["grad_accum"],
    steps: Annotated[Optional[int], Field("steps")] = None,  # noqa: UP045
    epochs: Annotated[Optional[float], Field("epochs")] = None,  # noqa: UP045
    lr: Annotated[float, Field("lr")] = D["lr"],
    weight_decay: Annotated[float, Field("weight_decay")] = D["weight_decay"],
    schedule: Annotated[str, Field("schedule")] = D["schedule"],
    warmup_steps: Annotated[Optional[int], Field("warmup_steps")] = None,  # noqa: UP045
    max_grad_norm: Annotated[float, Field("max_grad_norm")] = D["max_grad_norm"],
    aux_loss_coef: Annotated[Optional[float], Field("aux_loss_coef")] = None,  # noqa: UP045
    eval_every: Annotated[int, Field("eval_every")] = D["eval_every"],
    seed: Annotated[int, Field("seed")] = D["seed"],
    device: Annotated[str, Field("device")] = D["device"],
    autocast: Annotated[str, Field("autocast")] = D["autocast"],
    save_every: Annotated[int, Field("save_every")] = D["save_every"],
    keep_checkpoints: Annotated[int, Field("keep_checkpoints")] = D["keep_checkpoints"],
    resume: Annotated[bool, Field("resume", "--resume")] = False,
    force: Annotated[bool, Field("force", "--force")] = False,
    fsdp: Annotated[bool, Field("fsdp", "--fsdp")] = False,
    gradient_checkpointing: Annotated[bool, Field("gradient_checkpointing",
                                                  "--gradient-checkpointing")] = False,
    trust_remote_code: Annotated[bool, Field("trust_remote_code", "--trust-remote-code")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No tables or progress bar.")
                     ] = False,
) -> None:
    """Fine-tune an MoE's routers (default), or everything (--full; also a dense model, e.g.
    the compute-matched control of an MoE), on text; write OUT.

    Every option is also a field of a --config YAML file. Runs on one process or many:
    `torchrun --nproc-per-node N -m moemerge finetune ...`."""
    from moemerge.errors import RecipeError
    from moemerge.train.api import finetune as run_finetune
    from moemerge.train.config import make_config

    given = dict(locals())
    chosen = [flag for flag, on in (("--router-only", router_only), ("--full", full),
                                    ("--train", train is not None)) if on]
    if len(chosen) > 1:
        raise RecipeError(f"{' and '.join(chosen)}: give only one of --router-only, --train, "
                          "--full")
    # every TrainConfig field by its own name, given only when typed: a default here must not
    # override a --config file's value
    options = {name: given[name] if _typed(ctx, name) else None
               for name in TrainConfig.model_fields}
    options["train"] = (["routers"] if router_only else ["all"] if full
                        else [p.strip() for p in train.split(",")] if train is not None else None)
    options["data"] = data or None
    cfg = make_config(config, options)
    result = run_finetune(cfg, console=None if quiet else err, config_file=config)
    after = sum(d["ppl"] for d in result.after.values()) / len(result.after)
    before = sum(d["ppl"] for d in result.before.values()) / len(result.before)
    out.print(f"[green]finetuned[/] {cfg.output} ({result.steps} steps; mean held-out perplexity "
              f"{before:.2f} → {after:.2f})")
