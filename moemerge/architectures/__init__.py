"""Per-architecture tensor tables, kept as data, and the roles of tensors."""

from moemerge.architectures.tables import (
    DenseFamily,
    MoELayout,
    TensorRole,
    dense_families,
    family_for_config,
    moe_layouts,
)

__all__ = [
    "DenseFamily", "MoELayout", "TensorRole", "dense_families", "family_for_config", "moe_layouts",
]
