"""The merge-method registry: every method's name, base policy, parameters and tensor function.

One entry per method. The recipe schema (moemerge/recipe/merge.py), `validate`, `--dry-run`,
the tuner (which parameters it may vary), the CLI help and docs/merge-methods.md's parameter
table are all generated from `REGISTRY`, so a new method is one function, one entry here and
its tests. This module imports no torch: the recipe layer reads it to validate a recipe without
loading a tensor library, and each function is imported on first use (`MethodSpec.function`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

Base = Literal["required", "optional", "ignored"]


@dataclass(frozen=True)
class Param:
    """One recipe parameter. `kind` is float, int, bool or a tuple of allowed strings. Float
    ranges: `low` < x (or ≤ with `low_closed`), x ≤ `high` (or < with `high_open`). A float
    parameter may also be a list: a per-layer gradient (values spread evenly over the layers,
    interpolated linearly, as in mergekit). `per_model`: a model's entry in the recipe may set
    its own value (mergekit's tensor parameters), which wins over the merge block's. A default
    of None: the parameter has none (mergekit requires it) and a recipe must set it."""

    name: str
    kind: type | tuple[str, ...]
    default: object
    doc: str
    low: float | None = None
    high: float | None = None
    low_closed: bool = False
    high_open: bool = False
    tunable: bool = False
    per_model: bool = False

    @property
    def required(self) -> bool:
        return self.default is None

    @property
    def arg(self) -> str:
        """The keyword of the tensor function (`lambda` is a Python keyword)."""
        return "lam" if self.name == "lambda" else self.name

    def range_text(self) -> str:
        if isinstance(self.kind, tuple):
            return " \\| ".join(self.kind)
        if self.kind is bool:
            return "true \\| false"
        if self.low is None and self.high is None:
            return "any"
        lo = "" if self.low is None else ("[" if self.low_closed else "(") + f"{self.low:g}"
        hi = "" if self.high is None else f"{self.high:g}" + (")" if self.high_open else "]")
        return f"{lo or '(-inf'}, {hi or 'inf)'}"

    def check(self, value: object) -> str | None:
        """Why a single (non-gradient) value is out of range, or None."""
        if isinstance(self.kind, tuple):
            return None if value in self.kind else f"must be one of {', '.join(self.kind)}"
        if self.kind in (float, int) and isinstance(value, bool):
            return f"must be a number, got {str(value).lower()}"
        if self.kind in (float, int) and isinstance(value, int | float):
            bad_low = self.low is not None and (value < self.low if self.low_closed
                                                else value <= self.low)
            bad_high = self.high is not None and (value >= self.high if self.high_open
                                                  else value > self.high)
            if value != value or value in (float("inf"), float("-inf")):
                return f"must be a finite number, got {value}"
            if bad_low or bad_high:
                return f"must be in {self.range_text()}, got {value}"
        return None


@dataclass(frozen=True)
class MethodSpec:
    name: str
    summary: str
    paper: str
    base: Base
    params: tuple[Param, ...] = ()
    target: str | None = None  # "module:function"; None for `base` (a copy, no arithmetic)
    min_models: int = 1
    max_models: int | None = None
    weights: bool = True  # uses the models' `weight`
    signed_weights: bool = False  # linear in the weights: a negative weight subtracts a model
    random: bool = False  # takes the per-tensor draws (merge/draws.py)
    moe: str | None = None  # why it cannot merge the non-FFN tensors of an MoE, if it cannot
    constraint: Callable[[dict], str | None] | None = None  # across parameters, on scalars
    # "module:function" returning the whole-tensor statistics that let the method run in row
    # blocks (merge/blocks.py); unset: never
    blocks: str | None = None
    # (parameter, value) pairs that need the whole tensor at once even so
    whole_if: tuple[tuple[str, object], ...] = ()
    # "module:function" of a compiled kernel giving the same bytes (merge/native), tried first;
    # it returns None where it does not apply, and the torch code runs
    native: str | None = None

    def problem(self, values: dict[str, object]) -> str | None:
        """Why these parameter values (defaults filled in) do not go together, or None."""
        full = {p.name: values.get(p.name, p.default) for p in self.params}
        missing = [name for name, value in full.items() if value is None]
        if missing:
            return f"{self.name} needs {', '.join(missing)} (it has no default)"
        # gradients (lists) are checked where they are evaluated, per tensor
        if self.constraint is None or any(isinstance(v, list) for v in full.values()):
            return None
        models = max((len(v) for v in full.values() if isinstance(v, tuple)), default=0)
        if not models:
            return self.constraint(full)
        # per-model values (tuples): each model's own combination
        return next((problem for i in range(models) if (problem := self.constraint(
            {k: v[i] if isinstance(v, tuple) else v for k, v in full.items()}))), None)

    @property
    def needs_base(self) -> bool:
        return self.base == "required"

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)

    @property
    def per_model(self) -> tuple[str, ...]:
        """The parameters a model's own entry may set (`weight` is not one: it is the model's
        for every method that takes weights)."""
        return tuple(p.name for p in self.params if p.per_model)

    @property
    def tunable(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params if p.tunable)

    @property
    def function(self) -> Callable:
        return load_target(self.target)

    @property
    def native_function(self) -> Callable | None:
        return None if self.native is None else load_target(self.native)

    @property
    def block_statistics(self) -> Callable | None:
        return None if self.blocks is None else load_target(self.blocks)

    def runs_in_blocks(self, params: dict) -> bool:
        """Whether a large tensor merges in row blocks with these parameters (what dispatch
        does, known before any data is read: the memory estimate's question too)."""
        return self.blocks is not None and not any(
            params.get(name) == value for name, value in self.whole_if)


def load_target(target: str | None) -> Callable:
    """The object a "module:attribute" target names."""
    module, _, attr = (target or "").partition(":")
    return getattr(importlib.import_module(module), attr)


# |lambda| beyond 1000 scales a task vector past any weight a model holds (1e38 overflowed the
# float32 merge into Inf): a typo, refused with the range
LAMBDA = Param("lambda", float, 1.0, "scale of the merged task vector", low=-1000.0, high=1000.0,
               low_closed=True, tunable=True)
DENSITY = Param("density", float, 0.7, "fraction of each task vector's entries kept",
                low=0.0, high=1.0, tunable=True, per_model=True)
NORMALIZE = Param("normalize", bool, True, "divide the weights by their sum (linear methods) or "
                  "by the agreeing models' weights (sign-consensus methods)")
ROUNDING = Param("trim_rounding", ("ceil", "floor", "sort"), "ceil", "entries kept: ceil(d·n) "
                 "(ties at the cut-off kept), floor(d·n), or sort: exactly floor(d·n), ties at "
                 "the cut-off broken as torch's sort of the whole tensor orders them (mergekit's "
                 "choice, entry for entry; whole tensors, not row blocks)")
SORTED = (("trim_rounding", "sort"),)  # mergekit's cut by a sort of the whole tensor
ZERO_VOTE = Param("zero_vote", ("none", "positive"), "none", "sign elected where the vote sums "
                  "to exactly 0: none (entry stays at the base) or positive (mergekit)")
CONSENSUS = Param("consensus", ("sum", "count"), "sum", "sign election by mass (sum of the "
                  "weighted task vectors) or by count (sum of their signs)")
RESCALE = Param("rescale", ("expectation", "l1", "none"), "expectation", "survivors × 1/p (p "
                "their keep probability), × ‖τ‖₁/‖kept‖₁ per tensor (mergekit), or not at all")
GAMMA = Param("gamma", float, 0.01, "fraction of largest-magnitude entries dropped",
              low=0.0, high=1.0, low_closed=True, high_open=True, per_model=True)
EPSILON = Param("epsilon", float, 0.15, "keep probabilities spread over density ± epsilon by "
                "magnitude rank", low=0.0, high=1.0, low_closed=True, high_open=True,
                per_model=True)
SCALE = Param("scale", float, 1.0, "factor the tensor is multiplied by (0 silences it)",
              low=-1000.0, high=1000.0, low_closed=True, per_model=True)
T = Param("t", float, 0.5, "interpolation factor: 0 gives the first model, 1 the second",
          low=0.0, high=1.0, low_closed=True)
MAX_ITER = Param("max_iter", int, 10, "Karcher iterations at most", low=0, low_closed=False)
TOL = Param("tol", float, 1e-5, "Karcher stopping tolerance (tangent norm)", low=0.0)
FILTER_WISE = Param("filter_wise", bool, False, "one angle per output row instead of one per "
                    "tensor")
TOPK = Param("select_topk", float, 1.0, "fraction of entries kept, those of largest variance "
             "across the models", low=0.0, high=1.0)
CONSENSUS_PARAMS = (NORMALIZE, ZERO_VOTE, CONSENSUS)
NUSLERP_FLATTEN = Param("nuslerp_flatten", bool, True, "one angle for the whole tensor; false: "
                        "one per vector along the last axis (rows), or the first with "
                        "nuslerp_row_wise")
NUSLERP_ROW_WISE = Param("nuslerp_row_wise", bool, False, "without nuslerp_flatten: vectors "
                         "along the first axis (a matrix's columns) instead of the last")
# nearswap's t and RAM's epsilon under names of their own: `t` (slerp's) and `epsilon`
# (DELLA's, per model) mean other things here; import-mergekit renames them
SWAP_DISTANCE = Param("swap_distance", float, None, "entries within this distance of the "
                      "model's take its value; the others move this far toward it "
                      "(mergekit's nearswap t)", low=0.0, low_closed=True)
NONZERO_THRESHOLD = Param("nonzero_threshold", float, 1e-5, "|τ| above which a model counts as "
                          "having changed an entry (mergekit's ram epsilon)", low=0.0,
                          low_closed=True)
RAM_R = Param("r", float, 0.1, "boost of the entries one model alone changed: × (1 + r·min(ρ, "
              "alpha)), ρ its shared/unique ratio", low=0.0, low_closed=True)
RAM_ALPHA = Param("alpha", float, 0.2, "cap on each model's shared/unique ratio ρ", low=0.0,
                  low_closed=True)


def _della_fits(v: dict) -> str | None:
    d, e = v["density"], v["epsilon"]
    if d < 1 and not (0 < d - e and d + e < 1):
        return f"density ± epsilon must lie in (0, 1); got density {d:g}, epsilon {e:g}"
    return None

_M = "moemerge.merge."


def _spec(name, summary, paper, base, params=(), target=None, blocks=None, **kw) -> MethodSpec:
    return MethodSpec(name, summary, paper, base, tuple(params),
                      target if target is None else _M + target,
                      blocks=blocks if blocks is None else _M + "blocks:" + blocks, **kw)


METHOD_SPECS = (
    _spec("base", "the base model's tensor, copied", "–", "required"),
    _spec("average", "weighted mean of the models (weighted sum without normalize)",
          "Wortsman et al. 2022, model soups", "ignored", (NORMALIZE,), "methods:average",
          "elementwise", signed_weights=True),
    _spec("task_arithmetic", "base + λ Σ w τ", "Ilharco et al. 2023", "required",
          (LAMBDA, NORMALIZE), "methods:task_arithmetic", "elementwise", signed_weights=True),
    _spec("ties", "trim, elect sign, disjoint mean", "Yadav et al. 2023", "required",
          (DENSITY, LAMBDA, ROUNDING, *CONSENSUS_PARAMS), "methods:ties", "trim_thresholds",
          whole_if=SORTED, native=_M + "native:ties"),
    _spec("dare_linear", "random drop and rescale, then task arithmetic", "Yu et al. 2024",
          "required", (DENSITY, LAMBDA, NORMALIZE, RESCALE), "methods:dare_linear", "dare_l1",
          random=True, signed_weights=True),
    _spec("dare_ties", "random drop and rescale, then TIES's election and disjoint mean",
          "Yu et al. 2024", "required", (DENSITY, LAMBDA, RESCALE, *CONSENSUS_PARAMS),
          "methods:dare_ties", "dare_l1", random=True),
    _spec("breadcrumbs", "drop the largest gamma and the smallest entries, then task arithmetic",
          "Davari & Belilovsky 2024", "required",
          (replace(DENSITY, default=0.9), GAMMA, LAMBDA, NORMALIZE, ROUNDING),
          "sparse:breadcrumbs", "outlier_thresholds", signed_weights=True, whole_if=SORTED),
    _spec("breadcrumbs_ties", "breadcrumbs' drop, then TIES's election and disjoint mean",
          "Davari & Belilovsky 2024", "required",
          (replace(DENSITY, default=0.9), GAMMA, LAMBDA, ROUNDING, *CONSENSUS_PARAMS),
          "sparse:breadcrumbs_ties", "outlier_thresholds", whole_if=SORTED),
    _spec("della", "magnitude-ranked random drop (MagPrune), then TIES's election and mean",
          "Deep et al. 2024", "required", (DENSITY, EPSILON, LAMBDA, RESCALE, *CONSENSUS_PARAMS),
          "sparse:della", "della_l1", random=True, constraint=_della_fits),
    _spec("della_linear", "magnitude-ranked random drop (MagPrune), then task arithmetic",
          "Deep et al. 2024", "required", (DENSITY, EPSILON, LAMBDA, NORMALIZE, RESCALE),
          "sparse:della_linear", "della_l1", random=True, constraint=_della_fits,
          signed_weights=True),
    _spec("sce", "select by variance, weight by mean square, erase minority signs",
          "Wan et al. 2024, FuseChat", "required", (TOPK, LAMBDA, ZERO_VOTE), "sparse:sce",
          weights=False),
    _spec("slerp", "spherical interpolation of two models", "Shoemake 1985", "ignored", (T,),
          "sphere:slerp", min_models=2, max_models=2, weights=False),
    _spec("multislerp", "weighted spherical barycentre (of the task vectors with a base)",
          "Goddard 2025, mergekit", "optional", (NORMALIZE,), "sphere:multislerp"),
    _spec("karcher", "Riemannian (Karcher) mean on the sphere, scaled by the mean norm",
          "Karcher 1977; mergekit", "ignored", (MAX_ITER, TOL), "sphere:karcher"),
    _spec("model_stock", "interpolate the average towards the base by the fine-tunes' angle",
          "Jang et al. 2024", "required", (FILTER_WISE,), "sphere:model_stock", min_models=2,
          weights=False),
    _spec("nuslerp", "spherical interpolation of two models (or task vectors), t from their "
          "weights; per tensor, row or column", "mergekit (Goddard 2024)", "optional",
          (NUSLERP_FLATTEN, NUSLERP_ROW_WISE), "sphere:nuslerp", min_models=2, max_models=2),
    _spec("nearswap", "the model's entries near the base's, elsewhere the base moved a step "
          "toward it", "alchemonaut 2024, QuartetAnemoi model card", "required",
          (SWAP_DISTANCE,), "swap:nearswap", "elementwise", max_models=1, weights=False),
    _spec("arcee_fusion", "the model's entries whose importance |Δ|·KL is a Tukey outlier, "
          "else the base's", "Arcee AI 2025, mergekit", "required", (), "swap:arcee_fusion",
          max_models=1, weights=False),
    _spec("ram", "per entry, the mean change of the models that changed it",
          "RAM, arXiv 2601.13572", "required", (NONZERO_THRESHOLD,), "ram:ram", "elementwise",
          weights=False),
    _spec("ramplus_tl", "RAM, each model's unique entries boosted by its shared/unique ratio "
          "(per tensor)", "RAM+, arXiv 2601.13572", "required",
          (RAM_R, RAM_ALPHA, NONZERO_THRESHOLD), "ram:ramplus_tl", weights=False),
    _spec("passthrough", "one model's tensor as it is (layer stacking with `slices`)",
          "Goddard et al. 2024, mergekit", "ignored", (SCALE,), "sphere:passthrough",
          "elementwise",
          max_models=1, weights=False, moe="passthrough copies one model's tensors; in an MoE "
          "use method: base (the base's) or average"),
)
REGISTRY: dict[str, MethodSpec] = {m.name: m for m in METHOD_SPECS}
METHOD_NAMES = tuple(REGISTRY)


def get(name: str) -> MethodSpec:
    if name not in REGISTRY:
        raise ValueError(f"unknown merge method {name!r}; choose from {', '.join(METHOD_NAMES)}")
    return REGISTRY[name]


def per_model_params() -> dict[str, Param]:
    """Every parameter some method lets a model set for itself."""
    return {name: p for name, p in all_params().items() if p.per_model}


def all_params() -> dict[str, Param]:
    """Every parameter name used by some method (each name means one thing everywhere)."""
    out: dict[str, Param] = {}
    for spec in METHOD_SPECS:
        for p in spec.params:
            out.setdefault(p.name, p)
    return out
