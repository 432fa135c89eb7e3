"""`--fsdp` under torchrun: FSDP2 (`fully_shard`), and full tensors in and out of the shards.

Each rank keeps a 1/N slice (dim 0) of every parameter as a DTensor; a layer's parameters are
all-gathered for its forward and again for its backward, and its gradients reduce-scattered
back to the slices, so parameters, gradients and AdamW states take 1/N the memory.

Groups: one per decoder layer (transformers' `_no_split_modules` classes), then the root
(embeddings, final norm, head); moemerge's own kinds (seq_routed, bridged, merged_experts) are
one root group (see `_layer_groups`). A group may mix trainable and frozen parameters (router-only:
the router inside its frozen layer): FSDP2 all-gathers every parameter of the group but
reduce-scatters only those with gradients, and the optimizer holds only the trainable ones, so
frozen parameters still get no gradient and no optimizer state. The one constraint, a single
dtype among a group's trainable parameters, holds (fp32).

A sequence-routed model (seq_routed, bridged) is one group, the root, whatever its
`_no_split_modules`: a forward runs only the experts its sequences go to (all of them in
training with a learned router; the top k in evaluation, or with perplexity / task-vector
routing), so with per-layer groups ranks whose sequences went to different experts would join
different all-gathers (measured on the TINY experts: a hang in the first evaluation). With one
group every rank gathers the whole model once per forward, whatever its routing; gradients and
AdamW states are still sharded.

Checkpoints and the export hold full tensors whatever the sharding: a sharded tensor is gathered
with `full_tensor()` (a collective every rank joins, one tensor at a time, kept on rank 0 only)
and a full value is cut back into this rank's slice with `distribute_tensor`.
"""

from __future__ import annotations

import torch

from moemerge.errors import RecipeError
from moemerge.recipe.kinds import Kind
from moemerge.train.distributed import Dist

try:  # public from torch 2.5; older versions have no FSDP2, hence no sharded tensors
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover
    DTensor = type("DTensor", (), {})  # nothing is an instance


def shard_model(model: torch.nn.Module, ctx: Dist) -> torch.nn.Module:
    """Shard `model` in place over ctx.world ranks (its parameters become DTensors on
    ctx.device); set requires_grad before, and look the parameters up again after."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        raise RecipeError("--fsdp needs torch >= 2.6 (FSDP2's fully_shard)") from None
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    for module in _layer_groups(model):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if hasattr(model, "set_reduce_scatter_unused_params"):  # torch >= 2.11
        # per-expert parameters (transformers 4): an expert no token of this rank chose has no
        # gradient here but may have one elsewhere; reduce zeros so every rank joins the same
        # reduce-scatters (DDP's find_unused_parameters). Fused experts always have gradients.
        model.set_reduce_scatter_unused_params(True)
    return model


def _layer_groups(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules sharded as groups of their own, before the root (see the module docstring)."""
    if not Kind.of_config(model.config).layer_shards:
        # one group: sequence routing runs different experts on different ranks, and merged
        # experts compute every layer's merged weights before the backbone runs
        return []
    layers = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in layers]


def _full(tensor: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """A CPU copy of `tensor`'s full value where `keep`, else None; a DTensor is gathered first
    (a collective: every rank must call this, in the same order)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to("cpu", copy=True) if keep else None


def gather(tensors: dict[str, torch.Tensor], keep: bool) -> dict[str, torch.Tensor]:
    """{name: full CPU copy} where `keep` (rank 0), {} elsewhere."""
    full = {name: _full(t, keep) for name, t in tensors.items()}
    return full if keep else {}


def gather_optimizer_state(state: dict, keep: bool) -> dict:
    """`optimizer.state_dict()` with every DTensor state (AdamW's exp_avg, exp_avg_sq: shaped as
    their parameter) gathered: the same int-keyed layout and full tensors as without FSDP."""
    inner = {i: {k: _full(v, keep) if isinstance(v, DTensor) else v for k, v in s.items()}
             for i, s in state["state"].items()}
    return {**state, "state": inner}


def shard_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Full `value` laid out as `like`: this rank's slice if `like` is a DTensor (a collective),
    else `value` itself."""
    if not isinstance(like, DTensor):
        return value
    return distribute_tensor(value.to(like.device_mesh.device_type), like.device_mesh,
                             like.placements)


def shard_optimizer_state(state: dict, optimizer: torch.optim.Optimizer) -> dict:
    """Inverse of `gather_optimizer_state` for `optimizer`: each state shaped as its parameter
    is cut to the parameter's slice (the 0-d `step` is left alone)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in state["param_groups"] for i in group["params"]]
    like = dict(zip(ids, params, strict=True))
    inner = {i: {k: shard_like(v, like[i]) if torch.is_tensor(v) and v.shape == like[i].shape
                 else v for k, v in s.items()}
             for i, s in state["state"].items()}
    return {**state, "state": inner}
