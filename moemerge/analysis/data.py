"""Per-domain evaluation text for `moemerge inspect --data`: moemerge.data's rules (docs/data.md).

`load_domain_texts` is the name from before moemerge.data; new code calls `domain_texts`."""

from __future__ import annotations

from moemerge.data import domain_texts as load_domain_texts

__all__ = ["load_domain_texts"]
