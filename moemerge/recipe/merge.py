"""The `merge` block of a recipe, generated from the merge-method registry
(moemerge/merge/registry.py): one optional field per parameter any method takes, each checked
against its range, and each checked against the method it is given for.

A float parameter may be a list, a per-layer gradient (mergekit's convention: values spread
evenly from the first layer to the last, interpolated linearly). A model's own setting of a
per-model parameter (`Setting`: a number, a gradient, or conditions each selecting tensors like
an override) is checked here too (`setting_problems`); the planner resolves all of them in one
place, moemerge/plan/params.py.
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, create_model, field_validator, model_validator

from moemerge.merge.registry import METHOD_NAMES, REGISTRY, Param, all_params, per_model_params
from moemerge.recipe.unquoted import UnquotedNumbers

Role = Literal["embed", "attn", "norm", "ffn", "lm_head", "router"]  # router: MoE inputs'
MethodName = Literal[METHOD_NAMES]  # type: ignore[valid-type]
METHODS_NEEDING_BASE = {m.name for m in REGISTRY.values() if m.needs_base}


def _annotation(p: Param) -> object:
    if isinstance(p.kind, tuple):
        return Literal[p.kind] | None  # type: ignore[valid-type]
    if p.kind is float:
        return float | list[float] | None
    return p.kind | None


@cache
def param_fields() -> dict[str, str]:
    """{recipe name: field name} of every merge parameter (`lambda` is the field `lam`)."""
    return {name: p.arg for name, p in all_params().items()}


def _check_range(cls, value, info):
    p = all_params()[next(n for n, f in param_fields().items() if f == info.field_name)]
    if isinstance(value, list):
        if not value:
            raise ValueError("a per-layer gradient needs at least one value")
        problems = [p.check(v) for v in value]
    else:
        problems = [p.check(value)]
    problem = next((x for x in problems if x), None)
    if problem:
        raise ValueError(problem)
    return value


def _no_bool_numbers(cls, value, info):
    """Before pydantic reads it: `true` where a number (or a gradient of numbers) is expected is
    an error, not 1.0."""
    p = all_params()[next(n for n, f in param_fields().items() if f == info.field_name)]
    values = value if isinstance(value, list) else [value]
    if p.kind in (float, int) and any(isinstance(v, bool) for v in values):
        raise ValueError(f"must be a number{' or a list of numbers' if p.kind is float else ''}"
                         f", got {str(value).lower()}")
    return value


class _Params(UnquotedNumbers):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def given(self) -> set[str]:
        """The recipe names of the parameters set here."""
        fields = {f: n for n, f in param_fields().items()}
        return {fields[f] for f in self.model_fields_set if f in fields}


MergeParams = create_model(
    "MergeParams", __base__=_Params, __doc__="How a group of tensors is merged. Unset fields "
    "take the method's defaults (moemerge/merge/registry.py).",
    __validators__={"_range": field_validator(*param_fields().values())(_check_range),
                    "_no_bools": field_validator(*param_fields().values(), mode="before")(
                        _no_bool_numbers)},
    method=(MethodName | None, None),
    **{p.arg: (_annotation(p), Field(default=None, alias=p.name if p.arg != p.name else None,
                                     description=p.doc))
       for p in all_params().values()},
)


def _values(params: _Params) -> dict[str, object]:
    values = {n: getattr(params, f) for n, f in param_fields().items()}
    return {n: v for n, v in values.items() if v is not None}


def _unused(method: str, given: set[str]) -> str | None:
    spec = REGISTRY[method]
    extra = sorted(given - {p.name for p in spec.params})
    if not extra:
        return None
    takes = ", ".join(p.name for p in spec.params) or "no parameters"
    return f"{', '.join(extra)}: not a parameter of {method} (it takes {takes})"


class Selector(UnquotedNumbers):
    """Which tensors something applies to: roles, layers and/or name substrings, all that are
    given must match (none given: every tensor)."""

    roles: list[Role] | None = None
    layers: list[int] | None = Field(default=None, description="Layer indices; None = all.")
    tensors: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, min_length=1, description="Substrings of the output tensor's name "
        "(mergekit's `filter`): it applies to a tensor whose name contains one.")

    def selects(self, role: str, layer: int | None, name: str | None) -> bool:
        """Whether this applies to tensor `name` of `role` in `layer` (every selector given
        must match)."""
        return ((self.roles is None or role in self.roles)
                and (self.layers is None or layer in self.layers)
                and (self.tensors is None or (name is not None
                                              and any(t in name for t in self.tensors))))


class Override(MergeParams, Selector):
    """Parameters for the tensors of some roles, layers and/or names (later overrides win)."""

    @model_validator(mode="after")
    def _selects_something(self) -> Override:
        if self.roles is None and self.layers is None and self.tensors is None:
            raise ValueError("an override needs `roles`, `layers` and/or `tensors` to say what "
                             "it applies to")
        return self


Value = float | list[float]  # a number, or a per-layer gradient


class Condition(Selector):
    """One value of a model's own setting, for the tensors it selects (mergekit's
    `{filter, value}`); without selectors it applies to every tensor."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    value: Value


# A model's own setting: a number, a gradient, or conditions (the first that selects a tensor
# gives its value; where none does, the merge block's value applies)
Setting = float | list[float] | list[Condition]


def as_conditions(value: object) -> object:
    """Before pydantic reads a setting: one condition alone is a list of one; true/false where
    a number is expected is an error, not 1.0."""
    if any(isinstance(v, bool) for v in _raw_numbers(value)):
        raise ValueError(f"must be a number, a list of numbers or of conditions, got {value!r}")
    return [value] if isinstance(value, dict) else value


def _raw_numbers(value: object) -> list[object]:
    """The values of a setting as YAML gave them (conditions' and gradients' unpacked)."""
    if isinstance(value, dict):
        return _raw_numbers(value.get("value"))
    if isinstance(value, list):
        return [v for item in value for v in _raw_numbers(item)]
    return [value]


def setting_values(setting: object) -> list[float]:
    """Every number a setting holds (its gradients' and conditions' values)."""
    if isinstance(setting, list):
        return [v for item in setting for v in setting_values(
            item.value if isinstance(item, Condition) else item)]
    return [] if setting is None else [setting]


def _gradients(setting: object) -> list[object]:
    """The lists of numbers in a setting: itself, or its conditions' values."""
    if not isinstance(setting, list):
        return []
    values = [c.value for c in setting if isinstance(c, Condition)]
    return values if values else [setting]


def setting_problem(name: str, setting: object) -> str | None:
    """Why a model's own setting of `name` (`weight` or a per-model parameter) is invalid."""
    if any(isinstance(g, list) and not g for g in _gradients(setting)):
        return "a per-layer gradient needs at least one value"
    param = per_model_params().get(name)
    if param is None:
        return None
    return next((p for p in map(param.check, setting_values(setting)) if p), None)


class MergeSpec(MergeParams):
    """The merge of the non-FFN (or, for `kind: merge`, all) tensors."""

    method: MethodName = "average"
    overrides: list[Override] = Field(default_factory=list)

    @property
    def methods(self) -> set[str]:
        return {self.method} | {o.method for o in self.overrides if o.method}

    @model_validator(mode="after")
    def _params_fit_methods(self) -> MergeSpec:
        """A parameter given for a method that does not take it is an error, not ignored. An
        override without `method` may set the parameters of any method of this block."""
        problems = [_unused(self.method, self.given()),
                    REGISTRY[self.method].problem(_values(self))]
        for i, o in enumerate(self.overrides):
            if o.method:
                problems.append(_unused(o.method, o.given()))
                problems.append(REGISTRY[o.method].problem({**_values(self), **_values(o)}))
            elif all(_unused(m, o.given()) for m in self.methods):
                problems.append(f"overrides.{i}: " + _unused(self.method, o.given()))
        problems = [p for p in problems if p]
        if problems:
            raise ValueError("; ".join(problems))
        return self


def method_problems(merge: MergeSpec, n_models: int, *, has_base: bool, moe: bool) -> list[str]:
    """What the methods of a `merge` block cannot do with these inputs (n_models: the models,
    experts, or one slice's sources): a missing base, too few or too many models, a method that
    makes no sense for an MoE's shared tensors."""
    problems = []
    needing = sorted(merge.methods & METHODS_NEEDING_BASE)
    if needing and not has_base:
        problems.append(f"base_model: merge method(s) {', '.join(needing)} need a base_model")
    for name in sorted(merge.methods):
        spec = REGISTRY[name]
        if moe and spec.moe:
            problems.append(f"merge.method: {name} cannot merge an MoE's shared tensors: "
                            f"{spec.moe}")
        elif spec.target and n_models < spec.min_models:
            problems.append(f"merge.method: {name} needs at least {spec.min_models} models to "
                            f"merge, got {n_models}")
        elif spec.target and spec.max_models and n_models > spec.max_models:
            problems.append(f"merge.method: {name} merges at most {spec.max_models} models, "
                            f"got {n_models}")
    return problems
