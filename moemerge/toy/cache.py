"""One cache entry per made thing (toy sets, converted pretrained bases, real expert sets) under
$MOEMERGE_CACHE (default ~/.cache/moemerge).

An entry is made in a temporary sibling directory and renamed into place, and a file written
last inside it marks it complete: an interrupted make never looks complete, and the half-made
siblings of killed processes are swept on the next call. When two processes race, the first
rename wins and the loser uses its entry.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from moemerge.cache import cache_root, check_entry, private_dir, seal
from moemerge.io.atomic import owned_tempdir, sweep_stale


def entry_path(*parts: str, cache_dir: Path | None = None) -> Path:
    """Where the cache entry `parts` lives: under `cache_dir`, else under $MOEMERGE_CACHE."""
    return Path(cache_dir or cache_root()).joinpath(*parts)


def cached_entry(final: Path, done_file: str, make: Callable[[Path], None],
                 rebuild: bool = False) -> Path:
    """`final`, made by `make(tmp)` unless it already holds `done_file` (which `make` writes
    last) and `rebuild` is false. `tmp` does not exist when `make` is called. The directories
    above `final` are made private (mode 0700), and an entry is used only if nobody else could
    have written it (moemerge.cache.check_entry: a CacheError otherwise)."""
    private_dir(root=final.parent)
    sweep_stale(final.parent, f".{final.name}-")
    if (final / done_file).is_file() and not rebuild:
        return check_entry(final)
    tmp = owned_tempdir(final.parent, f".{final.name}-")
    try:
        make(tmp / "entry")
        seal(tmp / "entry")
        if final.exists() and (rebuild or not (final / done_file).is_file()):
            # a stale or half-made entry: move it aside first, so the rename below can succeed
            shutil.rmtree(final.rename(tmp.with_name(tmp.name + "-old")), ignore_errors=True)
        try:
            (tmp / "entry").rename(final)
        except OSError:  # another process won the race: use its entry
            if not (final / done_file).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return check_entry(final)
