"""Outputs appear whole or not at all: build in a temporary directory, rename at the end."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from moemerge.errors import OutputError


@contextmanager
def atomic_output_dir(out: Path, *, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to `out`; on success it is renamed to `out`.

    The temporary name starts with a dot and says what it is (`.out.moemerge-tmp-XXXX`), so an
    interrupted build leaves nothing named `out`; on an exception it is removed. An existing
    `out` is refused unless `force`, and then replaced only once the new one is complete: the
    old one is moved aside, the new one renamed in, and the old one deleted."""
    out = Path(out)
    if out.exists() and not force:
        raise OutputError(f"{out} already exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.moemerge-tmp-", dir=out.parent))
    try:
        yield tmp
    except BaseException:  # KeyboardInterrupt too: nothing half-written may stay behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _install(tmp, out, force)


def _install(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished `tmp` to `out`, replacing an existing `out` only with `force`."""
    if not out.exists():
        _rename_or_clean(tmp, out)
        return
    if not force:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"{out} appeared while building; pass --force to replace it")
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.moemerge-old-", dir=out.parent))
    out.rename(aside / out.name)
    try:
        _rename_or_clean(tmp, out)
    except BaseException:
        (aside / out.name).rename(out)  # put the old output back where it was
        aside.rmdir()
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _rename_or_clean(tmp: Path, out: Path) -> None:
    try:
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# what a model directory carries besides weights and config: tokenizer and generation files
SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
    "generation_config.json",
)
RECIPE_COPY = "moemerge_recipe.yaml"  # the recipe `moemerge build` leaves next to the weights


def copy_side_files(src: Path, dst: Path, names: Iterable[str]) -> list[str]:
    """Copy the files among `names` that exist in `src` (tokenizer files and the like) into
    `dst`, keeping their timestamps; return the names copied."""
    copied = []
    for name in names:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied
