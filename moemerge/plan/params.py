"""Resolve the merge parameters of one tensor from the recipe's spec, its role and its layer."""

from __future__ import annotations

from dataclasses import dataclass

from moemerge.merge.registry import get
from moemerge.recipe.merge import MergeSpec, param_fields

FIRST = ("lambda", "density", "t")  # shown by describe() even at their defaults


@dataclass(frozen=True)
class ResolvedMerge:
    """Fully specified merge of one tensor: the method and every one of its parameters (the
    recipe's value, else the registry's default), gradients already evaluated at the layer."""

    method: str
    values: tuple[tuple[str, object], ...] = ()

    @property
    def params(self) -> dict[str, object]:
        return dict(self.values)

    def get(self, name: str) -> object:
        return self.params.get(name)

    def with_values(self, **values) -> ResolvedMerge:
        """These parameters changed, where the method has them (others are ignored)."""
        params = self.params
        params.update({k: v for k, v in values.items() if k in params and v is not None})
        return ResolvedMerge(self.method, tuple(params.items()))

    def describe(self) -> str:
        if not self.values:
            return self.method
        spec, params = get(self.method), self.params
        shown = [n for n in FIRST if n in params] + [
            p.name for p in spec.params if p.name not in FIRST and params[p.name] != p.default]
        return f"{self.method}({', '.join(f'{n}={_text(params[n])}' for n in shown)})"


def _text(value: object) -> str:
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
                  tensor: str | None = None) -> ResolvedMerge:
    """Start from the spec's top-level fields, then apply the overrides that select this
    tensor (`tensor`: the output tensor's name) in order; then the method's defaults for what is
    still unset. Gradients are evaluated at `at` = (index, count) when given (a layer of a
    slice), else at (layer, num_layers)."""
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
    return ResolvedMerge(method, tuple(
        (p.name, p.default if given.get(p.name) is None else at_layer(given[p.name], index,
                                                                      count))
        for p in method_spec.params))


def override_layer_warnings(spec: MergeSpec, num_layers: int) -> list[str]:
    """A warning per override naming layers the model does not have (they never apply)."""
    warnings = []
    for index, override in enumerate(spec.overrides):
        beyond = sorted({n for n in override.layers or () if not 0 <= n < num_layers})
        if beyond:
            warnings.append(f"merge.overrides[{index}].layers: {beyond[:10]} beyond the output's "
                            f"{num_layers} layers (0..{num_layers - 1}); the override never "
                            "applies there")
    return warnings
