"""Tiny models made offline from text every machine has: random checkpoints of each supported
family (for tests) and sets of branched domain experts (for `moemerge demo` and the test-suite).
"""

from moemerge.toy.corpora import DOMAINS, domain_text, domain_texts
from moemerge.toy.experts import (
    DEMO,
    FAMILIES,
    QUALITY,
    TINY,
    ToySet,
    ToySpec,
    cached_toy_experts,
    make_random_model,
    make_toy_experts,
)
from moemerge.toy.tokenizer import train_tokenizer, with_added_tokens

__all__ = [
    "DEMO",
    "DOMAINS",
    "FAMILIES",
    "QUALITY",
    "TINY",
    "ToySet",
    "ToySpec",
    "cached_toy_experts",
    "domain_text",
    "domain_texts",
    "make_random_model",
    "make_toy_experts",
    "train_tokenizer",
    "with_added_tokens",
]
