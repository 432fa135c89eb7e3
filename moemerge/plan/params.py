"""Resolve the merge parameters of one tensor from the recipe's spec, its role and its layer."""

from __future__ import annotations

from dataclasses import dataclass

from moemerge.merge.methods import DEFAULT_DENSITY, DEFAULT_LAMBDA
from moemerge.recipe.models import METHODS_WITH_DENSITY, MergeSpec


@dataclass(frozen=True)
class ResolvedMerge:
    """Fully specified merge of one tensor; `density` is None for methods without one."""

    method: str
    lam: float = DEFAULT_LAMBDA
    density: float | None = None
    normalize: bool = True

    def describe(self) -> str:
        if self.method in ("base", "average"):
            return self.method
        extra = f", density={self.density:g}" if self.density is not None else ""
        return f"{self.method}(lambda={self.lam:g}{extra})"


def resolve_merge(spec: MergeSpec, role: str, layer: int | None) -> ResolvedMerge:
    """Start from the spec's top-level fields, then apply matching overrides in order."""
    method, lam, density, normalize = spec.method, spec.lam, spec.density, spec.normalize
    for override in spec.overrides:
        if override.roles is not None and role not in override.roles:
            continue
        if override.layers is not None and layer not in override.layers:
            continue
        method = override.method or method
        lam = override.lam if override.lam is not None else lam
        density = override.density if override.density is not None else density
        normalize = override.normalize if override.normalize is not None else normalize
    uses_density = method in METHODS_WITH_DENSITY
    return ResolvedMerge(
        method=method,
        lam=DEFAULT_LAMBDA if lam is None else lam,
        density=(DEFAULT_DENSITY if density is None else density) if uses_density else None,
        normalize=True if normalize is None else normalize,
    )


def override_layer_warnings(spec: MergeSpec, num_layers: int) -> list[str]:
    """A warning per override naming layers the model does not have (they never apply)."""
    warnings = []
    for index, override in enumerate(spec.overrides):
        beyond = sorted({n for n in override.layers or () if not 0 <= n < num_layers})
        if beyond:
            warnings.append(f"merge.overrides[{index}].layers: {beyond[:10]} beyond the model's "
                            f"{num_layers} layers (0..{num_layers - 1}); the override never "
                            "applies there")
    return warnings
