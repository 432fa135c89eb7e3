"""The one rule for every file and directory moemerge writes, reports included.

An output is never an input (a model directory or a file in one, the recipe, a config, data),
never sits inside one, never replaces an existing file or directory without --force, and
appears whole or not at all: a directory through `atomic_output_dir`, a single file (a report:
`inspect --json/--markdown/--plot`, `route --json`, `import-mergekit -o`) through
`write_output_file`, which writes `.NAME.moemerge-tmp-<pid>-XXXX` beside it and renames it.
A rename replaces a symlink at the output path, never the file it points to.

`check_output` is the check, run once before any work (so a refusal costs nothing) and again
by `write_output_file` just before the rename.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from moemerge.errors import OutputError, RecipeError
from moemerge.io.atomic import (
    NO_SPACE,
    TMP_TAG,
    NoSpaceLeft,
    current_umask,
    deferred_signals,
    fsync_dir,
    fsync_path,
    owner_gone,
)
from moemerge.io.paths import check_output_apart, working_directory

Inputs = Iterable[tuple[str, Path]]


def local_inputs(what: str, refs: Iterable[str | Path], *, near: Iterable[Path] = ()
                 ) -> list[tuple[str, Path]]:
    """(what, path) for each of `refs` that is a local file or directory (as written, or
    relative to a directory of `near`); hub ids and missing paths are not inputs here."""
    found = []
    for ref in refs:
        text = str(ref)
        spec = text.partition("=")[2] if "=" in text and not Path(text).exists() else text
        for candidate in (Path(spec).expanduser(), *(Path(d) / spec for d in near)):
            if candidate.exists():
                found.append((what, candidate))
                break
    return found


def check_output(out: Path, inputs: Inputs = (), *, force: bool, option: str = "output",
                 directory: bool = False, suffixes: Iterable[str] | None = None,
                 contained: Inputs = ()) -> Path:
    """Refuse `out` (the value of `option`) before any work: equal to, inside or around an
    input (RecipeError, exit 2, with or without --force; paths compared with symlinks
    resolved), equal to or around a directory of `contained` or the working directory, a
    directory where a file goes, an existing output without `force` (OutputError), or a file
    name whose suffix is not in `suffixes` (RecipeError). Returns `out` as a Path."""
    out = Path(out)
    check_output_apart(out, list(inputs), contained=[*contained, working_directory()])
    if suffixes is not None:
        allowed = sorted(suffixes)
        if out.suffix.lower().lstrip(".") not in allowed:
            raise RecipeError(f"{option} {out}: the file name must end in one of "
                              f"{', '.join('.' + s for s in allowed)}")
    if not os.path.lexists(out):
        return out
    if not directory and out.is_dir() and not out.is_symlink():
        raise OutputError(f"{option} {out} is a directory; give a file name")
    if not force:
        raise OutputError(f"{option} {out} already exists; pass --force to replace it")
    return out


def write_output_file(out: Path, content: str | bytes | Callable[[Path], None],
                      inputs: Inputs = (), *, force: bool, option: str = "output") -> Path:
    """Write one output file under the rule: checked as `check_output` does, written to a
    temporary file beside it (the same suffix, so a writer that goes by it, such as
    matplotlib's savefig, writes the same format), fsynced and renamed over `out`.
    `content` is the text, the bytes, or a function that writes the file at the path it is
    given."""
    out = check_output(out, inputs, force=force, option=option)
    parent = out.absolute().parent
    if not parent.is_dir():
        raise OutputError(f"{option} {out}: directory {parent} does not exist")
    sweep_stale_files(parent, f".{out.name}.{TMP_TAG}")
    with deferred_signals():  # Ctrl-C lands once `tmp` is known
        try:
            fd, name = tempfile.mkstemp(prefix=f".{out.name}.{TMP_TAG}{os.getpid()}-",
                                        suffix=out.suffix, dir=parent)
        except OSError as exc:
            raise OutputError(f"cannot write {option} {out}: {exc.strerror} "
                              f"({exc.filename or parent})") from None
    tmp = Path(name)
    try:
        os.close(fd)
        os.chmod(tmp, 0o666 & ~current_umask())
        if callable(content):
            content(tmp)
        else:
            tmp.write_bytes(content.encode() if isinstance(content, str) else content)
        fsync_path(tmp)
        if os.path.lexists(out) and not force:  # it appeared meanwhile
            raise OutputError(f"{option} {out} appeared while writing; pass --force to "
                              "replace it")
        os.replace(tmp, out)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno in NO_SPACE:
            raise NoSpaceLeft(out, exc.strerror, f"writing {option}", 2**20,
                              cleaned=True) from None
        raise
    fsync_dir(parent)
    return out


def sweep_stale_files(parent: Path, prefix: str) -> list[Path]:
    """Remove the `prefix<pid>-*` temporary files in `parent` whose process is gone."""
    owner = re.compile(re.escape(prefix) + r"(\d+)-")
    removed = []
    for stale in sorted(Path(parent).glob(f"{glob_escape(prefix)}*")):
        found = owner.match(stale.name)
        if found and stale.is_file() and not stale.is_symlink() and owner_gone(int(found[1])):
            stale.unlink(missing_ok=True)
            removed.append(stale)
    return removed


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def plot_suffixes() -> list[str]:
    """The file types matplotlib's savefig writes (png, pdf, svg, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())
