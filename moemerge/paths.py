"""Where moemerge keeps what it makes once and reuses: $MOEMERGE_CACHE, default
~/.cache/moemerge (toy and real expert sets, converted bases, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("MOEMERGE_CACHE") or Path.home() / ".cache" / "moemerge")
