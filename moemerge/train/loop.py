"""The one training loop: AdamW on the selected parameters, warm-up then cosine/linear decay,
gradient accumulation and clipping, autocast on CUDA, per-domain evaluation.

Loss = mean next-token cross-entropy over the step's blocks (+ aux_loss_coef × the Switch
load-balancing loss the model returns with output_router_logits: over tokens for Mixtral and
Qwen-MoE, over sequences for a learned sequence router; params.check_aux_loss refuses it where
there is none). Each micro-batch's loss is divided by grad_accum, and DDP (or FSDP's
reduce-scatter) averages over ranks, so the gradient is the global-batch mean whatever the split
into ranks and micro-batches.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moemerge.errors import RecipeError
from moemerge.token_blocks import Blocks, global_batch
from moemerge.train.config import TrainConfig
from moemerge.train.distributed import Dist, all_sum, shard


@dataclass
class Optim:
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR


def make_optim(params: list[torch.nn.Parameter], cfg: TrainConfig, steps: int) -> Optim:
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else math.ceil(0.1 * steps)

    def factor(step: int) -> float:  # multiplier of lr after `step` scheduler steps
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, steps - warmup)
        if cfg.schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return Optim(opt, torch.optim.lr_scheduler.LambdaLR(opt, factor))


def _autocast(ctx: Dist):
    """Mixed precision for forward passes (distributed.setup chooses): the parameters, the
    optimizer and the loss stay float32."""
    if ctx.autocast is None:
        return nullcontext()
    return torch.autocast(ctx.device.type, dtype=ctx.autocast)


def _loss(model, block: torch.Tensor, aux_coef: float, ctx: Dist) -> tuple[torch.Tensor, float]:
    """(loss to backpropagate, the plain LM loss) of blocks [b, T + 1]."""
    block = block.to(ctx.device)
    with _autocast(ctx):
        # use_cache off: training needs no KV cache (a sequence-routed model keeps one per expert)
        out = model(input_ids=block[:, :-1], output_router_logits=aux_coef > 0, use_cache=False)
    lm = F.cross_entropy(out.logits.float().flatten(0, 1), block[:, 1:].flatten())
    if aux_coef > 0 and getattr(out, "aux_loss", None) is None:
        raise RecipeError(f"--aux-loss-coef {aux_coef}: {type(model).__name__} returned no "
                          "load-balancing loss (aux_loss); leave it at 0")
    total = lm + aux_coef * out.aux_loss.float() if aux_coef > 0 else lm
    return total, lm.item()


def train_step(model, optim: Optim, blocks: Blocks, step: int, cfg: TrainConfig, ctx: Dist,
               trainable: list[torch.nn.Parameter]) -> dict:
    """One optimizer step on global batch `step`; returns its metrics (same on every rank)."""
    started = time.perf_counter()
    mine = shard(global_batch(blocks.train_ids, step, cfg.batch_size, cfg.seed), ctx)  # [B/N]
    micro = mine.view(cfg.grad_accum, -1)  # [accum, B/(N·accum)]
    lm_sum = 0.0
    for i, ids in enumerate(micro):
        last = i == len(micro) - 1
        # DDP all-reduces only the last micro-batch. FSDP reduce-scatters each one into the
        # sharded gradients: skipping that (set_requires_gradient_sync(False)) would keep the
        # unsharded gradients, as large as all trainable parameters (--full: the whole model),
        # on every rank until the last, which is the memory --fsdp exists to save.
        unsynced = ctx.world > 1 and not ctx.sharded and not last
        sync = model.no_sync() if unsynced else nullcontext()
        with sync:
            total, lm = _loss(model, blocks.tokens[ids], cfg.aux_loss_coef or 0.0, ctx)
            (total / cfg.grad_accum).backward()
        lm_sum += lm
    norm = (torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
            if cfg.max_grad_norm > 0 else torch.tensor(float("nan")))
    lr = optim.scheduler.get_last_lr()[0]
    optim.optimizer.step()
    optim.scheduler.step()
    optim.optimizer.zero_grad(set_to_none=True)
    loss = all_sum(torch.tensor([lm_sum / cfg.grad_accum], dtype=torch.float64), ctx)
    seconds = time.perf_counter() - started
    tokens = cfg.batch_size * cfg.seq_len
    return {"type": "train", "step": step + 1, "loss": loss.item() / ctx.world, "lr": lr,
            "grad_norm": float(norm), "tokens": tokens, "tokens_per_s": tokens / seconds}


def _nll(model, block: torch.Tensor, ctx: Dist) -> torch.Tensor:
    """Per-token next-token loss [b, T] of blocks [b, T + 1]."""
    block = block.to(ctx.device)
    with _autocast(ctx):
        logits = model(input_ids=block[:, :-1], use_cache=False).logits.float()  # [b, T, V]
    return F.cross_entropy(logits.transpose(1, 2), block[:, 1:], reduction="none")


@torch.no_grad()
def evaluate(model, blocks: Blocks, ctx: Dist, batch: int = 8) -> dict[str, dict[str, float]]:
    """{domain: {loss, ppl}} on the held-out blocks; each rank scores a strided share and the
    sums are all-reduced, so every rank gets the same figures. Under FSDP every forward is a
    collective, so each rank runs as many as the largest share needs, the ones past its own
    share on a stand-in block whose loss is dropped."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(len(blocks.domains), 2, dtype=torch.float64)  # [D, (nll sum, tokens)]
    mine = blocks.eval_ids[ctx.rank:: ctx.world]
    largest = -(-len(blocks.eval_ids) // ctx.world) if ctx.sharded else len(mine)
    for start in range(0, largest, batch):
        ids = mine[start: start + batch]
        if not len(ids):  # FSDP only: this rank's share is done
            _nll(model, blocks.tokens[blocks.eval_ids[:1]], ctx)
            continue
        nll = _nll(model, blocks.tokens[ids], ctx)  # [b, T]
        for d, row in zip(blocks.domain[ids].tolist(), nll.sum(1).tolist(), strict=True):
            sums[d] += torch.tensor([row, nll.shape[1]], dtype=torch.float64)
    sums = all_sum(sums, ctx)
    model.train(was_training)
    return {d: {"loss": (s[0] / s[1]).item(), "ppl": math.exp((s[0] / s[1]).item())}
            for d, s in zip(blocks.domains, sums, strict=True) if s[1] > 0}


def run(model, optim: Optim, blocks: Blocks, cfg: TrainConfig, ctx: Dist, *, start: int,
        steps: int, trainable: list[torch.nn.Parameter],
        on_step: Callable[[dict], None], save: Callable[[int], None],
        bare: torch.nn.Module) -> None:
    """Steps start..steps-1; `on_step` gets every metrics record, `save(step)` checkpoints
    (on every rank). `bare` is the model without DDP, for evaluation (ranks may score unequal
    shares); under FSDP it is the sharded model itself."""
    model.train()
    for step in range(start, steps):
        on_step(train_step(model, optim, blocks, step, cfg, ctx, trainable))
        done = step + 1
        if cfg.eval_every and done % cfg.eval_every == 0 and done < steps:
            on_step({"type": "eval", "step": done, "domains": evaluate(bare, blocks, ctx)})
        if cfg.save_every and done % cfg.save_every == 0 and done < steps:
            save(done)
