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
    """Yield a temporary directory next to `out`; on success it becomes `out`.

    The temporary name starts with a dot and says what it is, so a killed build leaves nothing
    named `out`. An existing `out` is replaced only with `force`, and only after the new one is
    complete (moved aside, then deleted)."""
    out = Path(out)
    if out.exists() and not force:
        raise OutputError(f"{out} already exists; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.moemerge-tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            if not force:
                raise OutputError(f"{out} appeared while building; pass --force to replace it")
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.moemerge-old-", dir=out.parent))
            out.rename(old / out.name)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_side_files(src: Path, dst: Path, names: Iterable[str]) -> list[str]:
    """Copy the files among `names` that exist in `src` (tokenizer files and the like)."""
    copied = []
    for name in names:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied
