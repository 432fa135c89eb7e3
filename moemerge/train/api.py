"""`finetune(config)`: data → model → trainable selection → loop (resumable; DDP or FSDP) →
export."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from rich.console import Console

from moemerge.data import read_domains
from moemerge.errors import OutputError, RecipeError
from moemerge.io.atomic import check_free_space, sweep_output, sweep_stale
from moemerge.io.outputs import check_output
from moemerge.io.paths import check_output_apart, working_directory
from moemerge.io.reader import CheckpointReader
from moemerge.loading import check_seq_len, load_causal_lm
from moemerge.recipe.kinds import Kind
from moemerge.token_blocks import Blocks, make_blocks
from moemerge.train import checkpoint, distributed, loop, report, sharding
from moemerge.train.aux_loss import default_aux_loss_coef
from moemerge.train.config import TrainConfig
from moemerge.train.export import export, write_json
from moemerge.train.memory import enable_gradient_checkpointing
from moemerge.train.params import (
    check_aux_loss,
    learned_routing,
    router_modules,
    select_trainable,
)
from moemerge.words import plural


@dataclass
class FinetuneResult:
    output: Path
    steps: int
    trained: list[str]  # in-memory parameter names that trained
    before: dict[str, dict[str, float]]  # {domain: {loss, ppl}} on held-out blocks
    after: dict[str, dict[str, float]]
    records: list[dict] = field(default_factory=list)  # metrics.jsonl, in memory
    routing: object | None = None  # moemerge.analysis.routing.RoutingReport
    model: torch.nn.Module | None = None  # the trained model, in memory (fp32); FSDP: rank 0


def _load(cfg: TrainConfig, device: torch.device):
    with CheckpointReader(Path(cfg.model)) as reader:  # clear errors for a missing/truncated one
        ours = Kind.of_config(reader.config).remote_code
    # moemerge's own kinds load with the installed code, never the model dir's; other code
    # from the model dir only with --trust-remote-code
    trust = cfg.trust_remote_code and not ours
    model, tokenizer = load_causal_lm(cfg.model, trust_remote_code=trust)
    return model.to(device), tokenizer


def _check_outputs(cfg: TrainConfig, ctx: distributed.Dist, config_file: Path | None) -> None:
    out, root = Path(cfg.output), checkpoint.checkpoint_root(Path(cfg.output))
    data = [Path(spec.partition("=")[2] if "=" in spec and not Path(spec).exists() else spec)
            for spec in cfg.data]
    inputs = [("the input model", Path(cfg.model)),
              *[("--data", path) for path in data if path.exists()],  # not hub ids
              *([("the config file", config_file)] if config_file is not None else [])]
    check_output_apart(root, inputs, contained=[working_directory()])  # --force deletes it
    if ctx.main:  # what a killed run for this output left
        sweep_output(out)
        sweep_stale(root, checkpoint.TMP_PREFIX)
    check_output(out, inputs, force=cfg.force, directory=True)
    if root.exists() and not cfg.resume and checkpoint.latest(root) is not None:
        if not cfg.force:
            raise OutputError(f"{root} holds checkpoints of an earlier run; pass --resume to "
                              "continue it, or --force to delete them and start afresh")
        distributed.barrier(ctx)
        if ctx.main:
            shutil.rmtree(root)


def _check_space(cfg: TrainConfig, model: torch.nn.Module, names: list[str]) -> None:
    """Before training, as a build checks before writing: room for the exported model and,
    with save_every, the checkpoints on disk at once (keep_checkpoints and the one being
    written: the trained tensors and AdamW's two moments, fp32)."""
    with CheckpointReader(Path(cfg.model)) as reader:
        size = reader.total_bytes
    params = dict(model.named_parameters())
    state = 3 * 4 * sum(params[n].numel() for n in names)
    copies = cfg.keep_checkpoints + 1 if cfg.save_every else 0
    what = f" and {copies} training checkpoints in {checkpoint.checkpoint_root(Path(cfg.output))}"
    check_free_space(Path(cfg.output), size + copies * state, what if copies else "")


def finetune(cfg: TrainConfig, *, console: Console | None = None,
             on_step: Callable[[dict], None] | None = None,
             config_file: Path | None = None) -> FinetuneResult:
    """Train `cfg.train` parts of the MoE `cfg.model` (or the whole of a dense model, with
    `train: [all]`) on `cfg.data` and write `cfg.output`.
    `config_file`, the YAML `cfg` came from, is an input the output must stay apart from."""
    ctx = distributed.setup(cfg.device, cfg.fsdp, cfg.autocast)
    try:
        return _finetune(cfg, ctx, console if ctx.main else None, on_step, config_file)
    finally:
        distributed.teardown(ctx)


def _finetune(cfg, ctx, console, on_step, config_file) -> FinetuneResult:
    _check_outputs(cfg, ctx, config_file)
    if cfg.batch_size % (ctx.world * cfg.grad_accum):
        raise RecipeError(f"batch_size (--batch-size) {cfg.batch_size} must be divisible by "
                          f"{ctx.world} ranks × grad_accum {cfg.grad_accum}")
    texts = read_domains(cfg.data, text_field=cfg.text_field,  # data errors before any weights
                         label_field=cfg.label_field)
    # FSDP: each rank loads the model on the CPU and moves only its shards to the device
    model, tokenizer = _load(cfg, torch.device("cpu") if ctx.sharded else ctx.device)
    check_seq_len(cfg.seq_len, "seq_len (--seq-len)", model.config, cfg.model)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    blocks = make_blocks(texts, tokenizer, cfg.seq_len, cfg.eval_fraction)
    names = select_trainable(model, cfg.train, cfg.model)
    if cfg.aux_loss_coef is None:  # resolved before the fingerprint a resume compares
        cfg = cfg.model_copy(update={"aux_loss_coef": default_aux_loss_coef(
            model, Path(cfg.model), cfg.train)})
    check_aux_loss(model, cfg.aux_loss_coef, cfg.model)
    _check_space(cfg, model, names)
    if ctx.sharded:  # replaces the parameters with DTensor shards: look them up after
        model = sharding.shard_model(model, ctx)
    params = dict(model.named_parameters())
    trainable = [params[n] for n in names]
    steps = cfg.total_steps(len(blocks.train_ids))
    torch.manual_seed(cfg.seed)
    optim = loop.make_optim(trainable, cfg, steps)
    records, start = _resume(cfg, params, optim, console)
    if not records:
        records.append({"type": "eval", "step": 0, "domains": loop.evaluate(model, blocks, ctx)})
    before = records[0]["domains"]
    if console:
        n = sum(p.numel() for p in trainable)  # a DTensor counts its full size
        how = " (FSDP)" if ctx.sharded else ""
        console.print(f"training {plural(len(names), 'tensor')} ({plural(n, 'parameter')}: "
                      f"{', '.join(cfg.train)}) on {plural(len(blocks.train_ids), 'block')} of "
                      f"{plural(cfg.seq_len, 'token')}, {plural(steps, 'step')}, "
                      f"{plural(ctx.world, 'process', 'processes')}{how} on {ctx.device}")
        console.print(report.eval_table(before, title="held-out loss before training"))
        if cfg.fsdp and ctx.world == 1:
            console.print("[yellow]note:[/] --fsdp shards the model over several processes "
                          "(torchrun --nproc-per-node N); one process trains it unsharded")

    def log(record: dict) -> None:
        records.append(record)
        bar(record)
        if on_step:
            on_step(record)

    def save(step: int) -> None:  # on every rank: gathering FSDP shards is a collective
        trained = sharding.gather({n: params[n] for n in names}, keep=ctx.main)
        optimizer = sharding.gather_optimizer_state(optim.optimizer.state_dict(), keep=ctx.main)
        if ctx.main:
            state = {"fingerprint": cfg.fingerprint(), "records": records, "trainable": trained,
                     "optimizer": optimizer, "scheduler": optim.scheduler.state_dict(),
                     "rng": checkpoint.rng_state()}
            checkpoint.save(checkpoint.checkpoint_root(Path(cfg.output)), step, state,
                            cfg.keep_checkpoints)
        distributed.barrier(ctx)

    wrapped = distributed.wrap(model, ctx, find_unused=not learned_routing(model))
    with report.progress_bar(console, steps, start) as bar:
        loop.run(wrapped, optim, blocks, cfg, ctx, start=start, steps=steps, trainable=trainable,
                 on_step=log, save=save, bare=model)
    after = loop.evaluate(model, blocks, ctx)
    records.append({"type": "eval", "step": steps, "domains": after})
    if ctx.sharded:
        model = _unsharded(cfg, params, names, ctx)
    result = FinetuneResult(Path(cfg.output), steps, names, before, after, records, model=model)
    if ctx.main:
        if console:
            console.print(report.eval_table(before, after, title="held-out loss and perplexity"))
        export(model, names, Path(cfg.model), Path(cfg.output), force=cfg.force,
               extra=lambda tmp: _reports(tmp, cfg, result, blocks, tokenizer, console))
    distributed.barrier(ctx)
    return result


def _resume(cfg, params, optim, console) -> tuple[list[dict], int]:
    """(metrics so far, first step) from the latest checkpoint with --resume, else ([], 0)."""
    if not cfg.resume:
        return [], 0
    def warn(message: str) -> None:
        if console:
            console.print(f"[yellow]warning:[/] {message}", highlight=False)
        else:
            warnings.warn(message, stacklevel=2)

    loaded = checkpoint.load_latest(checkpoint.checkpoint_root(Path(cfg.output)),
                                    cfg.fingerprint(), warn)  # full tensors, also under FSDP
    if loaded is None:
        if console:
            console.print("[yellow]note:[/] --resume: no checkpoint yet; starting afresh")
        return [], 0
    found, state = loaded
    with torch.no_grad():
        for name, value in state["trainable"].items():
            params[name].copy_(sharding.shard_like(value, params[name]))
    optim.optimizer.load_state_dict(sharding.shard_optimizer_state(state["optimizer"],
                                                                   optim.optimizer))
    optim.scheduler.load_state_dict(state["scheduler"])
    checkpoint.set_rng_state(state["rng"])
    if console:
        console.print(f"resuming from {found} (step {state['step']})")
    return list(state["records"]), state["step"]


def _unsharded(cfg: TrainConfig, params: dict[str, torch.Tensor], names: list[str],
               ctx: distributed.Dist) -> torch.nn.Module | None:
    """FSDP: the trained model as a plain one on rank 0, for the export and the reports (which
    run forwards on rank 0 alone): the source re-read on the CPU, the trained tensors gathered
    into it. None on the other ranks."""
    trained = sharding.gather({n: params[n] for n in names}, keep=ctx.main)
    if not ctx.main:
        return None
    model, _ = _load(cfg, torch.device("cpu"))
    plain = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in trained.items():
            plain[name].copy_(value)
    return model


def _reports(tmp: Path, cfg: TrainConfig, result: FinetuneResult, blocks: Blocks, tokenizer,
             console: Console | None) -> None:
    """OUT/training/: config, metrics.jsonl, loss.png, summary.json, routing.{json,png}."""
    where = tmp / "training"
    (where / "train_config.yaml").write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    report.write_metrics(where / "metrics.jsonl", result.records)
    report.loss_plot(where / "loss.png", result.records)
    write_json(where / "summary.json", {"steps": result.steps, "trained": result.trained,
                                        "before": result.before, "after": result.after})
    if not router_modules(result.model):  # a dense model trained --full: no routing to show
        return
    config = result.model.config
    from moemerge.analysis.routing import expert_labels, moe_shape, routing_report
    from moemerge.analysis.routing_render import plot, summary_table

    texts = {d: tokenizer.decode(blocks.tokens[blocks.eval_ids[blocks.domain[blocks.eval_ids] == i]]
                                 .flatten().tolist())
             for i, d in enumerate(blocks.domains)}
    n_experts = moe_shape(config, str(cfg.model))[0]
    labels = expert_labels(Path(cfg.model), n_experts)
    routing = routing_report(result.model, tokenizer, texts, seq_len=cfg.seq_len, labels=labels,
                             name=str(cfg.output))
    (where / "routing.json").write_text(routing.to_json())
    plot(routing, where / "routing.png")
    result.routing = routing
    if console:
        console.print(summary_table(routing))
