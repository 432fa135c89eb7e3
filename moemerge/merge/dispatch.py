"""`merge(method, ...)`: check the inputs against the method's registry entry, fill in its
defaults, and call its tensor function with the arguments it takes."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from moemerge.merge import blocks
from moemerge.merge.draws import Draws
from moemerge.merge.methods import Weights, weights_of
from moemerge.merge.registry import REGISTRY, MethodSpec, Param, all_params, get
from moemerge.words import plural


def call_arguments(spec: MethodSpec, params: dict[str, object],
                   n_models: int | None = None) -> dict[str, object]:
    """The keyword arguments of `spec`'s function: every parameter of the method, the given
    value (by recipe name, or `lam` for `lambda`) or the registry's default. A per-model
    parameter may be a sequence of one value per model (`n_models` of them). Parameters of other
    methods are ignored (the recipe refuses them); unknown names and out-of-range values are
    errors."""
    anywhere = {n for p in all_params().values() for n in (p.name, p.arg)}
    given = {k: v for k, v in params.items() if v is not None}
    unknown = sorted(set(given) - anywhere)
    if unknown:
        raise ValueError(f"{spec.name} takes no parameter {', '.join(unknown)}")
    args = {}
    for p in spec.params:
        value = given.get(p.name, given.get(p.arg, p.default))
        if value is None:
            raise ValueError(f"{spec.name} needs {p.name} (it has no default)")
        for one in _each_model(p, value, n_models):
            problem = p.check(one)
            if problem:
                raise ValueError(f"{p.name} {problem}")
        args[p.arg] = value
    return args


def _each_model(p: Param, value: object, n_models: int | None) -> list[object]:
    """The values of one parameter: itself, or its per-model values (checked in number)."""
    if not isinstance(value, list | tuple):
        return [value]
    if not p.per_model:
        raise ValueError(f"{p.name} takes one value for all models, got {list(value)}")
    if n_models is not None and len(value) != n_models:
        raise ValueError(f"{p.name}: {plural(len(value), 'per-model value')} for "
                         f"{plural(n_models, 'model')}")
    return list(value)


def check_weights(spec: MethodSpec, weights: Weights, n_models: int) -> None:
    """Weights in number; signed only where the method is linear in them (a negative weight
    subtracts a model); else at least 0 and not all 0."""
    w = weights_of(weights, n_models, normalize=False)
    if spec.signed_weights or not spec.weights:
        return
    if (w < 0).any():
        signed = ", ".join(m.name for m in REGISTRY.values() if m.signed_weights)
        raise ValueError(f"{spec.name} takes no negative weight, got {w.tolist()} (signed "
                         f"weights: {signed})")
    if w.sum() <= 0:
        raise ValueError(f"weights sum to {w.sum().item():g}; they must sum to more than 0")


def merge(method: str, *, base: Tensor | None, tensors: Sequence[Tensor], weights: Weights = None,
          draws: Draws | None = None, dtype: torch.dtype = torch.float32,
          block: int | None = None, **params) -> Tensor:
    """Validate, apply the registry's defaults and dispatch by name (`base` is a copy of the
    base and is done by the planner, not here). The result is in `dtype`; a tensor of more than
    `block` entries (default blocks.BLOCK_ELEMENTS) is merged in row blocks where the method
    allows it (merge/blocks.py).

    Integer and bool tensors (position ids, masks: buffers, not weights) are not merged: the
    first model's is returned unchanged. Methods whose base is `ignored` never use `base`."""
    spec = get(method)
    if spec.target is None:
        raise ValueError(f"{method} is a copy of the base tensor, not a merge")
    if not tensors:
        raise ValueError("nothing to merge")
    if spec.needs_base and base is None:
        raise ValueError(f"{method} needs a base tensor")
    if len(tensors) < spec.min_models or len(tensors) > (spec.max_models or len(tensors)):
        most = "" if spec.max_models is None else f" and at most {spec.max_models}"
        raise ValueError(f"{method} takes at least {spec.min_models}{most} models, got "
                         f"{len(tensors)}")
    uses_base = base is not None and spec.base != "ignored"
    shapes = {tuple(t.shape) for t in tensors} | ({tuple(base.shape)} if uses_base else set())
    if len(shapes) > 1:
        raise ValueError(f"tensors of different shapes cannot be merged: {sorted(shapes)}")
    check_weights(spec, weights, len(tensors))
    kwargs = call_arguments(spec, params, len(tensors))
    if not tensors[0].is_floating_point():
        return tensors[0]
    if spec.native is not None and (out := spec.native_function(
            base, tensors, weights, dtype=dtype, **kwargs)) is not None:
        return out
    rows = blocks.row_blocks(tensors[0].shape, block or blocks.BLOCK_ELEMENTS)
    statistics = spec.block_statistics
    extra = None if len(rows) == 1 or not spec.runs_in_blocks(kwargs) else statistics(
        base if uses_base else None, tensors, rows, **kwargs,
        **({"draws": draws} if spec.random else {}))  # the drop made again draws the same
    if spec.weights:
        kwargs["weights"] = weights
    if spec.random:
        kwargs["draws"] = draws
    if spec.base == "optional":
        kwargs["base"] = base
    pass_base = spec.base == "required"
    if extra is None:  # one piece
        out = spec.function(*([base] if pass_base else []), tensors, **kwargs)
        return out.to(dtype)
    return blocks.merge_in_blocks(spec.function, base, tensors, rows, dtype, pass_base,
                                  **kwargs, **extra)
