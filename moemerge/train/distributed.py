"""One process or many: torchrun's environment, the process group, the device, batch slices.

Under torchrun (WORLD_SIZE > 1) every rank joins a process group (gloo on CPU, nccl on CUDA),
wraps the model in DistributedDataParallel (or, with --fsdp, shards it: sharding.py) and takes a
disjoint slice of each global batch, so N ranks with B/N blocks each compute the same mean
gradient as one process with B.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moemerge.errors import RecipeError


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    sharded: bool = False  # --fsdp over several processes (one process trains unsharded)
    autocast: torch.dtype | None = None  # forward passes under torch.autocast in this dtype

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup(device: str, fsdp: bool = False, autocast: str = "auto") -> Dist:
    """Read torchrun's env, pick the device, and join the process group when world > 1.
    autocast "auto": bf16 (fp16 where bf16 is missing) on CUDA, none on the CPU (fp32: exact
    and reproducible); "bf16": bf16 on either (the CUDA path's arithmetic, testable on the
    CPU); "off": fp32."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RecipeError("--device cuda: torch sees no CUDA device here")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, world, local_rank, dev, sharded=fsdp and world > 1,
                autocast=_autocast_dtype(autocast, dev))


def _autocast_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return None
    if mode == "bf16" or torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float16


def wrap(model: torch.nn.Module, ctx: Dist, find_unused: bool = False) -> torch.nn.Module:
    """DDP over the trainable parameters when world > 1 (frozen ones are not synchronised);
    a sharded model is returned as it is. `find_unused`: some trainable parameters may get no
    gradient in a step (--full under task-vector routing: the base, the router), so DDP looks
    for them after each forward instead of waiting for their gradients forever."""
    if ctx.world == 1 or ctx.sharded:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # broadcast_buffers off: the models have no buffers that training changes (rotary caches)
    return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False,
                                   find_unused_parameters=find_unused)


def shard(batch: torch.Tensor, ctx: Dist) -> torch.Tensor:
    """This rank's contiguous slice of a global batch [B] (B divisible by world)."""
    per = len(batch) // ctx.world
    return batch[ctx.rank * per: (ctx.rank + 1) * per]


def all_sum(values: torch.Tensor, ctx: Dist) -> torch.Tensor:
    """Sum a small float64 tensor over ranks (identity in one process)."""
    if ctx.world > 1:
        values = values.to(ctx.device)
        dist.all_reduce(values)
    return values.cpu()


def barrier(ctx: Dist) -> None:
    if ctx.world > 1:
        dist.barrier()


def teardown(ctx: Dist) -> None:
    if ctx.world > 1 and dist.is_initialized():
        dist.destroy_process_group()
