"""Task-vector statistics (τ = expert − base), streamed one tensor name at a time.

For every (role, layer) group the sums below are accumulated exactly in float64, so a group's
cosine equals the cosine of its tensors' task vectors concatenated. docs/inspect.md defines
every statistic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moemerge.errors import RecipeError
from moemerge.merge.primitives import keep_count
from moemerge.plan.sources import open_sources
from moemerge.recipe.base import ModelRef
from moemerge.recipe.kinds import kind_of
from moemerge.recipe.load import load_recipe

ROLES = ("embed", "attn", "norm", "ffn", "lm_head")  # report order
CHUNK = 1 << 20  # entries per float64 block: temporaries stay at ~N × 8 MiB whatever the tensor


@dataclass
class GroupResult:
    """Finalised statistics of one group; matrices are N×N over experts, NaN where undefined."""

    role: str
    layer: int | None  # None: global tensors, or a whole-role summary
    numel: int
    cosine: list[list[float]]
    sign_conflict: list[list[float]]
    relative_norm: list[float]  # ‖τ_i‖ / ‖W_base‖
    ties_trimmed_mass: list[float]  # share of Σ τ_i² that TIES trimming removes
    all_sign_conflict: float  # NaN when no entry has two nonzero τ

    def pairs(self) -> list[tuple[int, int]]:
        n = len(self.relative_norm)
        return [(i, j) for i in range(n) for j in range(i + 1, n)]

    def pair_cosines(self) -> list[float]:
        return [self.cosine[i][j] for i, j in self.pairs() if not math.isnan(self.cosine[i][j])]

    def mean_cosine(self) -> float | None:
        cos = self.pair_cosines()
        return sum(cos) / len(cos) if cos else None

    def min_cosine(self) -> float | None:
        return min(self.pair_cosines(), default=None)

    def mean_sign_conflict(self) -> float | None:
        rates = [self.sign_conflict[i][j] for i, j in self.pairs()]
        rates = [r for r in rates if not math.isnan(r)]
        return sum(rates) / len(rates) if rates else None


class GroupStats:
    """Running sums over the tensors of one group. `update` with each tensor, then `finalize`."""

    def __init__(self, num_experts: int, density: float) -> None:
        n = num_experts
        self.density = density
        self.numel = 0
        self.gram = torch.zeros(n, n, dtype=torch.float64)  # Σ τ_i·τ_j; diagonal Σ τ_i²
        self.both = torch.zeros(n, n, dtype=torch.float64)  # #entries with τ_i ≠ 0 and τ_j ≠ 0
        self.opposite = torch.zeros(n, n, dtype=torch.float64)  # … of which signs differ
        self.trimmed_sq = torch.zeros(n, dtype=torch.float64)  # Σ τ_i² over trimmed entries
        self.base_sq = 0.0  # Σ W_base²
        self.multi = 0  # #entries where ≥ 2 experts' τ are nonzero
        self.mixed = 0  # #entries whose nonzero τ have both signs

    def update(self, base: torch.Tensor, experts: list[torch.Tensor]) -> None:
        base = base.reshape(-1)
        flat = [e.reshape(-1) for e in experts]
        for i, e in enumerate(flat):  # one float32 copy of one τ at a time
            self.trimmed_sq[i] += _trimmed_mass(e.float() - base.float(), self.density)
        for start in range(0, base.numel(), CHUNK):
            b = base[start : start + CHUNK].double()
            taus = torch.stack([e[start : start + CHUNK].double() for e in flat]) - b  # [N, c]
            self.gram += taus @ taus.T
            # 0/1 indicators: float32 counts are exact up to 2²⁴ > CHUNK
            pos, neg = (taus > 0).float(), (taus < 0).float()
            nonzero = pos + neg
            self.both += (nonzero @ nonzero.T).double()
            self.opposite += (pos @ neg.T + neg @ pos.T).double()
            self.multi += int((nonzero.sum(0) >= 2).sum())
            self.mixed += int((pos.amax(0) * neg.amax(0)).sum())
            self.base_sq += float(b.square().sum())
        self.numel += base.numel()

    def __iadd__(self, other: GroupStats) -> GroupStats:
        for name in ("numel", "gram", "both", "opposite", "trimmed_sq", "base_sq", "multi",
                     "mixed"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self

    def finalize(self, role: str, layer: int | None) -> GroupResult:
        sq = self.gram.diagonal()
        cosine = self.gram / (sq[:, None] * sq[None, :]).sqrt()  # 0/0 → NaN for an unmoved τ
        conflict = self.opposite / self.both
        base_norm = math.sqrt(self.base_sq)
        rel = [math.sqrt(s) / base_norm if base_norm else math.nan for s in sq.tolist()]
        trimmed = (self.trimmed_sq / sq).tolist()
        mixed = self.mixed / self.multi if self.multi else math.nan
        return GroupResult(
            role, layer, self.numel, cosine.tolist(), conflict.tolist(), rel, trimmed, mixed
        )


def _trimmed_mass(tau: torch.Tensor, density: float) -> float:
    """Σ τ² over the entries TIES's trim drops: those below the k-th largest |τ|, with
    k = keep_count(n, density) as in moemerge.merge (entries tied at the threshold are kept)."""
    keep = keep_count(tau.numel(), density)
    if keep >= tau.numel():
        return 0.0
    mag = tau.abs_().reshape(-1)
    threshold = mag.kthvalue(mag.numel() - keep + 1).values
    mag.masked_fill_(mag >= threshold, 0.0).square_()
    return sum(float(c.sum(dtype=torch.float64)) for c in mag.split(CHUNK))


@dataclass
class TaskVectorReport:
    base: tuple[str, str]  # (label, path)
    experts: list[tuple[str, str]]
    density: float
    groups: list[GroupResult]  # role order, then layer (global first)
    summary: dict[str, GroupResult] = field(default_factory=dict)  # per role, all layers

    @property
    def names(self) -> list[str]:
        return [label for label, _ in self.experts]


def collect(
    items: Iterable[tuple[str, int | None, torch.Tensor, list[torch.Tensor]]],
    num_experts: int,
    density: float,
) -> tuple[list[GroupResult], dict[str, GroupResult]]:
    """Feed (role, layer, base, experts) items into per-group stats; results and role summaries."""
    stats: dict[tuple[str, int | None], GroupStats] = {}
    for role, layer, base, experts in items:
        stats.setdefault((role, layer), GroupStats(num_experts, density)).update(base, experts)
        del base, experts  # before the next item is read: at most N + 1 tensors alive

    def order(key: tuple[str, int | None]) -> tuple[int, int]:
        role, layer = key
        return (ROLES.index(role) if role in ROLES else len(ROLES), -1 if layer is None else layer)

    keys = sorted(stats, key=order)
    summary: dict[str, GroupStats] = {}
    for role, layer in keys:
        summary.setdefault(role, GroupStats(num_experts, density))
        summary[role] += stats[(role, layer)]
    return (
        [stats[k].finalize(*k) for k in keys],
        {role: s.finalize(role, None) for role, s in summary.items()},
    )


Model = str | Path | ModelRef


def task_vector_report(
    base: Model,
    experts: list[Model],
    *,
    density: float = 0.7,
    labels: list[str] | None = None,
    progress: bool = False,
    recipe_dir: Path | None = None,
    allow_pickle: bool = False,
) -> TaskVectorReport:
    """Stream base + experts tensor by tensor (base reader's order): per tensor name, read the
    base's and each expert's tensor, update that group's sums, drop them."""
    if not 0.0 < density <= 1.0:
        raise RecipeError(f"--density: must be in (0, 1], got {density}")
    if not experts:
        raise RecipeError("EXPERT: give at least one expert model")
    refs = _labelled([_ref(m) for m in experts], labels)
    with ExitStack() as stack:
        models = open_sources(
            [("base", _ref(base)), *refs], recipe_dir, allow_pickle=allow_pickle, stack=stack
        )
        ref, others = models[0], models[1:]

        def items():
            for name in _track(ref.reader.names(), progress):
                role = ref.roles[name]
                yield role.role, role.layer, ref.reader.read(name), [
                    m.reader.read(name) for m in others
                ]

        groups, summary = collect(items(), len(others), density)
        return TaskVectorReport(
            ("base", str(ref.path)), [(m.label, str(m.path)) for m in others], density,
            groups, summary,
        )


def recipe_models(path: Path) -> tuple[ModelRef, list[ModelRef]]:
    """A build recipe's base_model and experts (kind: moe) or models (kind: merge)."""
    recipe = load_recipe(path)
    if recipe.base_model is None:
        raise RecipeError(
            f"{path}: base_model: missing; inspect needs a base model to compute task vectors "
            "(expert − base)"
        )
    return recipe.base_model, list(getattr(recipe, kind_of(recipe).inputs))


def _ref(model: Model) -> ModelRef:
    return model if isinstance(model, ModelRef) else ModelRef(model=str(model))


def _labelled(refs: list[ModelRef], labels: list[str] | None) -> list[tuple[str, ModelRef]]:
    """Labels as `build` gives them: the expert's name, else its directory's name; deduplicated."""
    out: list[tuple[str, ModelRef]] = []
    for index, ref in enumerate(refs):
        label = labels[index] if labels else getattr(ref, "name", None)
        label = label or Path(ref.model.rstrip("/")).name
        taken = {"base"} | {lab for lab, _ in out}
        out.append((label if label not in taken else f"{label}#{index + 1}", ref))
    return out


def _track(names: list[str], progress: bool) -> Iterable[str]:
    if not progress:
        return names
    from rich.console import Console
    from rich.progress import track

    return track(names, "inspecting", console=Console(stderr=True), transient=True)
