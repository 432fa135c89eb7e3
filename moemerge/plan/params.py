"""Resolve the merge parameters of one tensor from the recipe's spec, its role and its layer,
and the models' own settings: the one place where a parameter's value is decided.

Order, as mergekit resolves its tensor parameters: a model's own setting (its first condition
that selects the tensor, a gradient evaluated at the layer), else the merge block's (its last
override that selects the tensor and sets it, else its top-level value), else the registry's
default."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from moemerge.merge.registry import get
from moemerge.recipe.merge import Condition, MergeSpec, param_fields
from moemerge.words import plural

FIRST = ("lambda", "density", "t")  # shown by describe() even at their defaults


@dataclass(frozen=True)
class ResolvedMerge:
    """Fully specified merge of one tensor: the method and every one of its parameters (the
    recipe's value, else the registry's default), gradients already evaluated at the layer."""

    method: str
    values: tuple[tuple[str, object], ...] = ()
    # per-model parameters some model sets itself here: (name, (its value or None, per model))
    own: tuple[tuple[str, tuple[float | None, ...]], ...] = ()

    @property
    def params(self) -> dict[str, object]:
        """The arguments of the merge: a per-model parameter that some model sets is a tuple,
        each model's own value, else the merge block's."""
        out = dict(self.values)
        for name, values in self.own:
            out[name] = tuple(out[name] if v is None else v for v in values)
        return out

    def get(self, name: str) -> object:
        return self.params.get(name)

    def with_values(self, **values) -> ResolvedMerge:
        """The merge block's values of these parameters changed, where the method has them
        (others are ignored); a model's own value still wins over them."""
        shared = dict(self.values)
        shared.update({k: v for k, v in values.items() if k in shared and v is not None})
        return replace(self, values=tuple(shared.items()))

    @property
    def copies_its_one_model(self) -> bool:
        """Merging one model returns its tensor as it is: a normalised average, or passthrough
        at scale 1."""
        params = self.params
        if self.method == "passthrough":
            return params["scale"] in (1.0, (1.0,))
        return self.method == "average" and bool(params["normalize"])

    def describe(self) -> str:
        if not self.values:
            return self.method
        spec, params = get(self.method), self.params
        shown = [n for n in FIRST if n in params] + [
            p.name for p in spec.params if p.name not in FIRST and params[p.name] != p.default]
        return f"{self.method}({', '.join(f'{n}={_text(params[n])}' for n in shown)})"


def _text(value: object) -> str:
    if isinstance(value, tuple):  # one value per model
        return "[" + ", ".join(map(_text, value)) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value).lower()


def at_layer(value: object, index: int | None, count: int | None) -> object:
    """A per-layer gradient (a list) evaluated at layer `index` of `count` (the model's layers,
    or a slice's): the values are spread evenly from the first layer (fraction 0) to the last
    (fraction 1) and interpolated linearly; tensors outside the layers (embeddings, final
    norm, head) take fraction 0 and a one-layer slice fraction 1 (mergekit 0.1's rules; its
    0.0.6 took the final norm and head at fraction 1). A scalar is returned as is."""
    if not isinstance(value, list):
        return value
    if len(value) == 1:
        return value[0]
    if index is None or not count:
        fraction = 0.0
    else:
        fraction = 1.0 if count == 1 else index / (count - 1)
    scaled = fraction * (len(value) - 1)
    low = int(scaled)
    high = min(len(value) - 1, low + 1)
    return (1 - (scaled - low)) * value[low] + (scaled - low) * value[high]


def resolve_merge(spec: MergeSpec, role: str, layer: int | None,
                  num_layers: int | None = None, *,
                  at: tuple[int | None, int | None] | None = None,
                  tensor: str | None = None, models: Sequence = ()) -> ResolvedMerge:
    """Start from the spec's top-level fields, then apply the overrides that select this
    tensor (`tensor`: the output tensor's name) in order; then the method's defaults for what is
    still unset; then the merged `models`' own settings of the method's per-model parameters.
    Gradients are evaluated at `at` = (index, count) when given (a layer of a slice), else at
    (layer, num_layers)."""
    index, count = at if at is not None else (layer, num_layers)
    method = spec.method
    given = {name: getattr(spec, field) for name, field in param_fields().items()}
    for override in spec.overrides:
        if not override.selects(role, layer, tensor):
            continue
        method = override.method or method
        for name, field in param_fields().items():
            value = getattr(override, field)
            if value is not None:
                given[name] = value
    method_spec = get(method)
    values = tuple((p.name, p.default if given.get(p.name) is None else at_layer(
        given[p.name], index, count)) for p in method_spec.params)
    own = {name: tuple(setting_at(getattr(m, name, None), role, layer, tensor, index, count)
                       for m in models) for name in method_spec.per_model}
    return ResolvedMerge(method, values, tuple(
        (name, per_model) for name, per_model in own.items()
        if any(v is not None for v in per_model)))


def resolve_weights(models: Sequence, role: str, layer: int | None,
                    num_layers: int | None = None, *,
                    at: tuple[int | None, int | None] | None = None,
                    tensor: str | None = None) -> tuple[float, ...]:
    """Each model's weight for this tensor: its own setting, else 1."""
    index, count = at if at is not None else (layer, num_layers)
    weights = (setting_at(m.weight, role, layer, tensor, index, count) for m in models)
    return tuple(1.0 if w is None else float(w) for w in weights)


def setting_at(setting: object, role: str, layer: int | None, tensor: str | None,
               index: int | None, count: int | None) -> float | None:
    """A model's own setting at one tensor: a number as it is, a gradient at the layer, or the
    value of the first condition that selects the tensor; None where it has none (no setting,
    or no condition selects the tensor): the merge block's value applies (mergekit's
    fall-through)."""
    if isinstance(setting, list) and setting and isinstance(setting[0], Condition):
        chosen = next((c for c in setting if c.selects(role, layer, tensor)), None)
        return None if chosen is None else at_layer(chosen.value, index, count)
    return at_layer(setting, index, count)


def override_layer_warnings(spec: MergeSpec, num_layers: int) -> list[str]:
    """A warning per override naming layers the model does not have (they never apply)."""
    warnings = []
    for index, override in enumerate(spec.overrides):
        beyond = sorted({n for n in override.layers or () if not 0 <= n < num_layers})
        if beyond:
            warnings.append(f"merge.overrides[{index}].layers: {beyond[:10]} beyond the output's "
                            f"{plural(num_layers, 'layer')} (0..{num_layers - 1}); the override "
                            "never applies there")
    return warnings
