"""The same-base check: a new expert must be fine-tuned from the MoE's base (the recipe copy's
`base_model`), not merely of its shapes.

For a few tensors (the embedding, layer 0's and the last layer's FFN projections), read one
pair at a time, it measures the relative task vector r = ‖W_new − W_base‖ / ‖W_base‖ and the
cosine c = ⟨W_new, W_base⟩ / (‖W_new‖ ‖W_base‖). The two are tied: with ρ = ‖W_new‖ / ‖W_base‖,
r² = 1 + ρ² − 2ρc, so a model drawn independently of the base (c ≈ 0) has r ≈ √(1 + ρ²) ≥ 1,
while a fine-tune keeps c near 1. The decision is on c, because r alone does not separate the
cases: the tests' heavily perturbed experts (N(0, 0.05²) noise on N(0, 0.02²) weights) have
r ≈ 2.5, above an unrelated random model's ≈ 1.4, yet c ≈ 0.37 against ≈ 0 (docs/extend.md:
measured figures). A tensor with c < MIN_COSINE is refused, naming it with both figures.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from pathlib import Path

import torch

from moemerge.errors import CheckpointError, MismatchError
from moemerge.io.reader import CheckpointReader
from moemerge.plan.sources import SourceModel, open_sources, resolve_ref

MIN_COSINE = 0.1
ROWS = 4096  # rows per chunk: float64 copies of one chunk at a time


def probed(base: SourceModel) -> list[str]:
    """The base's tensors the check reads: its embedding, then layer 0's and the last layer's
    FFN weights."""
    last = int(base.config["num_hidden_layers"]) - 1
    embed = [n for n, r in base.roles.items() if r.role == "embed"]
    ffn = sorted(n for n, r in base.roles.items()
                 if r.role == "ffn" and r.layer in (0, last) and not n.endswith(".bias"))
    return embed + ffn


def figures(base: torch.Tensor, new: torch.Tensor) -> tuple[float, float]:
    """(relative task vector r, cosine c) of `new` against `base`, summed in float64 a chunk of
    rows at a time; (0, 1) for two all-zero tensors."""
    sums = torch.zeros(3, dtype=torch.float64)  # ‖Δ‖², ‖base‖², ⟨new, base⟩
    norm_new = torch.zeros((), dtype=torch.float64)
    b_rows, n_rows = base.reshape(base.shape[0], -1), new.reshape(new.shape[0], -1)
    for start in range(0, b_rows.shape[0], ROWS):
        b = b_rows[start:start + ROWS].double()
        n = n_rows[start:start + ROWS].double()
        sums += torch.stack([(n - b).square().sum(), b.square().sum(), (n * b).sum()])
        norm_new += n.square().sum()
    delta, norm_base, dot = (float(s) for s in sums)
    if norm_base == 0:
        return (0.0, 1.0) if delta == 0 else (float("inf"), 0.0)
    cosine = dot / (norm_base * float(norm_new)) ** 0.5 if float(norm_new) > 0 else 0.0
    return (delta / norm_base) ** 0.5, cosine


def check_same_base(base: SourceModel, expert: CheckpointReader, label: str) -> None:
    """Refuse `expert` (exit 1) when a probed tensor is not aligned with the base's. Run after
    the shape checks: a tensor the expert lacks, or of another shape, was refused there."""
    for name in probed(base):
        if name not in expert.names() or expert.meta(name).shape != base.reader.meta(name).shape:
            continue
        r, c = figures(base.reader.read(name), expert.read(name))
        if not math.isfinite(r):  # a NaN would read as "another base" (its cosine is no number)
            raise CheckpointError(f"{label}: tensor {name!r} holds NaN/Inf values")
        if c < MIN_COSINE:
            raise MismatchError(
                f"{label}: not fine-tuned from this MoE's base {base.path}: tensor {name!r} has a "
                f"relative task vector ‖W − W_base‖ / ‖W_base‖ of {r:.3g} and a cosine with the "
                f"base's of {c:.3g} (a fine-tuned expert stays aligned with its base: cosine "
                f"at least {MIN_COSINE}; a model of another initialisation or base is near 0). "
                "An expert must be fine-tuned from the same base")


def local_base(recipe, moe: Path, stack: ExitStack) -> SourceModel | None:
    """The recipe copy's base where it is at hand: a local directory (a relative path next to
    MOE, else in the working directory); None when the recipe names none or it is not there
    (a hub id is not fetched for the check)."""
    ref = getattr(recipe, "base_model", None)
    if ref is None:
        return None
    try:
        path = resolve_ref(ref, moe, hub=False)
    except CheckpointError:
        return None
    return open_sources([("base", ref.model_copy(update={"model": str(path)}))], None,
                        allow_pickle=False, stack=stack, compatible=False)[0]
