"""Outputs appear whole or not at all: build in a temporary directory, rename at the end.

A temporary directory carries its owner's pid in its name (`.out.moemerge-tmp-<pid>-XXXX`):
one left by a killed process (kill -9, power loss) is removed by the next run for the same
output, and never one whose owner still runs.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from moemerge.errors import OutputError
from moemerge.io.paths import confined

TMP_TAG = "moemerge-tmp-"
OLD_TAG = "moemerge-old-"
NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def owned_tempdir(parent: Path, prefix: str) -> Path:
    """A new directory `prefix<pid>-XXXX` in `parent`, with the mode the user's umask gives
    (mkdtemp's 0700 would otherwise become the output's mode)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent))
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def _umask() -> int:
    try:  # reading it does not change it (os.umask would, briefly, for every thread)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _owner_gone(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def sweep_stale(parent: Path, prefix: str, restore: Path | None = None) -> list[Path]:
    """Remove the `prefix<pid>-*` directories in `parent` whose process is gone (`prefix` may
    hold one `*`, e.g. `.step-*.tmp-`). With `restore`, one holding `restore.name` (an old
    output moved aside when its owner died between the two renames of a --force install) is
    put back first if `restore` is missing."""
    owner = re.compile(re.escape(prefix).replace(r"\*", r"[^/]*?") + r"(\d+)-")
    removed = []
    for stale in sorted(Path(parent).glob(f"{prefix}*")) if Path(parent).is_dir() else []:
        found = owner.match(stale.name)
        if not stale.is_dir() or found is None or not _owner_gone(int(found[1])):
            continue
        if restore is not None and not restore.exists() and (stale / restore.name).is_dir():
            (stale / restore.name).rename(restore)
        shutil.rmtree(stale, ignore_errors=True)
        removed.append(stale)
    return removed


def sweep_output(out: Path) -> list[Path]:
    """The stale temporary and set-aside directories of output `out`."""
    out = Path(out)
    return (sweep_stale(out.parent, f".{out.name}.{OLD_TAG}", restore=out)
            + sweep_stale(out.parent, f".{out.name}.{TMP_TAG}"))


@contextmanager
def atomic_output_dir(out: Path, *, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to `out`; on success it is renamed to `out`.

    The temporary name starts with a dot and says what it is (`.out.moemerge-tmp-<pid>-XXXX`),
    so an interrupted build leaves nothing named `out`; on an exception it is removed, and so
    are the parent directories this call created. An existing `out` is refused unless `force`,
    and then replaced only once the new one is complete: the old one is moved aside, the new
    one renamed in, and the old one deleted."""
    out = Path(out)
    if out.exists() and not force:
        raise OutputError(f"{out} already exists; pass --force to replace it")
    created = _make_parents(out.parent)
    try:
        sweep_output(out)
        tmp = owned_tempdir(out.parent, f".{out.name}.{TMP_TAG}")
    except OSError as exc:
        _remove_created(created)
        raise OutputError(f"cannot create the output {out}: {exc.strerror} "
                          f"({exc.filename or out.parent})") from None
    try:
        yield tmp
        fsync_tree(tmp)
    except BaseException as exc:  # KeyboardInterrupt too: nothing half-written may stay behind
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_created(created)
        if isinstance(exc, OSError) and exc.errno in NO_SPACE:
            raise OutputError(f"no space left on the device of {out} ({exc.strerror}): "
                              f"{free_bytes(out.parent) / 2**20:.1f} MiB free; nothing was "
                              "left behind") from None
        raise
    _install(tmp, out, force)
    fsync_dir(out.parent)


def _make_parents(parent: Path) -> list[Path]:
    """mkdir -p `parent`; the directories it made, outermost first."""
    missing = []
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    created = []
    try:
        for directory in reversed(missing):
            directory.mkdir()
            created.append(directory)
    except FileExistsError:
        pass
    except OSError as exc:
        _remove_created(created)
        raise OutputError(f"cannot create the output directory {exc.filename}: "
                          f"{exc.strerror}") from None
    return created


def _remove_created(created: list[Path]) -> None:
    for directory in reversed(created):
        try:
            directory.rmdir()
        except OSError:  # something else was put there meanwhile: not ours to remove
            return


def free_bytes(directory: Path) -> int:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return 0


def fsync_dir(directory: Path) -> None:
    """Make a directory's entries (renames, new files) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first."""
    for parent, _, files in sorted(os.walk(root), key=lambda e: -e[0].count(os.sep)):
        for name in files:
            fd = os.open(Path(parent) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(parent))


def _install(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished `tmp` to `out`, replacing an existing `out` only with `force`."""
    if not out.exists():
        _rename_or_clean(tmp, out)
        return
    if not force:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"{out} appeared while building; pass --force to replace it")
    aside = owned_tempdir(out.parent, f".{out.name}.{OLD_TAG}")
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
    `dst`, keeping their timestamps; return the names copied. A file that links outside `src`
    is refused (CheckpointError): it would copy e.g. /etc/passwd into the output."""
    copied = []
    for name in names:
        if (Path(src) / name).is_file():
            shutil.copy2(confined(Path(name), Path(src)), Path(dst) / name)
            copied.append(name)
    return copied
