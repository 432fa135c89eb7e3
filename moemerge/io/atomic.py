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
import signal
import tempfile
import threading
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
    os.chmod(tmp, 0o777 & ~current_umask())
    return tmp


def current_umask() -> int:
    try:  # reading it does not change it (os.umask would, briefly, for every thread)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def owner_gone(pid: int) -> bool:
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
        if not stale.is_dir() or found is None or not owner_gone(int(found[1])):
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


class NoSpaceLeft(OutputError):
    """The device of `where` filled up while `doing`; `needed`: the bytes still to write."""

    def __init__(self, where: Path, reason: str, doing: str, needed: int, *,
                 cleaned: bool = False):
        self.reason, self.doing, self.needed = reason, doing, needed
        left = "; nothing was left behind" if cleaned else ""
        super().__init__(f"no space left for {where} ({reason}) while {doing}: "
                         f"{space_needed(where, needed)}{left}")


def space_needed(where: Path, needed: int) -> str:
    """'it needs X MiB more, Y MiB are free' on the device `where` is (to be) on."""
    free = free_bytes(existing_ancestor(Path(where)))
    return f"it needs {needed / 2**20:.1f} MiB more, {free / 2**20:.1f} MiB are free"


SPACE_MARGIN = 1.02  # headers, config, tokenizer, card: a little over the tensor bytes


def check_free_space(out: Path, tensor_bytes: int, what: str = "") -> None:
    """Refuse up front an output the device of `out` cannot hold (ENOSPC half-way through a
    long build wastes the build); `tensor_bytes` from the plan, `what` says what they are."""
    parent = existing_ancestor(Path(out).absolute().parent)
    need, free = _needed(tensor_bytes, 0), free_bytes(parent)
    if need > free:
        raise OutputError(f"not enough space for {out}{what}: it needs about "
                          f"{need / 2**20:.1f} MiB and the device of {parent} has "
                          f"{free / 2**20:.1f} MiB free")


def existing_ancestor(path: Path) -> Path:
    """`path` or its nearest ancestor that exists."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@contextmanager
def atomic_output_dir(out: Path, *, force: bool = False, size: int | None = None
                      ) -> Iterator[Path]:
    """Yield a temporary directory next to `out`; on success it is renamed to `out`.

    The temporary name starts with a dot and says what it is (`.out.moemerge-tmp-<pid>-XXXX`),
    so an interrupted build leaves nothing named `out`; on an exception it is removed, and so
    are the parent directories this call created. An existing `out` is refused unless `force`,
    and then replaced only once the new one is complete: the old one is moved aside, the new
    one renamed in, and the old one deleted. `size` (the tensor bytes the output will hold) is
    checked against the free space before anything is created; a full device while writing
    is an OutputError naming `out`, the space still needed and the space free."""
    out = Path(out)
    if out.exists() and not force:
        raise OutputError(f"{out} already exists; pass --force to replace it")
    if size is not None:
        check_free_space(out, size)
    created = _make_parents(out.parent)
    tmp = None
    try:
        with deferred_signals():  # Ctrl-C / SIGTERM land once `tmp` is known, inside this try
            tmp = _create_tmp(out, created, size)
        yield tmp
        fsync_tree(tmp)
    except BaseException as exc:  # KeyboardInterrupt too: nothing half-written may stay behind
        if tmp is None:  # creating it failed; _create_tmp cleaned up
            raise
        full = _no_space(out, tmp, exc, size)  # before the cleanup frees what was written
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_created(created)
        if full is not None:
            raise full from None
        raise
    _install(tmp, out, force)
    fsync_dir(out.parent)


def _create_tmp(out: Path, created: list[Path], size: int | None) -> Path:
    try:
        sweep_output(out)
        return owned_tempdir(out.parent, f".{out.name}.{TMP_TAG}")
    except OSError as exc:
        _remove_created(created)
        if exc.errno in NO_SPACE:
            raise NoSpaceLeft(out, exc.strerror, "creating it", _needed(size, 0),
                              cleaned=True) from None
        raise OutputError(f"cannot create the output {out}: {exc.strerror} "
                          f"({exc.filename or out.parent})") from None


@contextmanager
def deferred_signals() -> Iterator[None]:
    """SIGINT and SIGTERM held back (delivered when the block ends) in the main thread, so a
    temporary directory is never made without its owner knowing its name."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _no_space(out: Path, tmp: Path, exc: BaseException, size: int | None) -> NoSpaceLeft | None:
    """`exc` (a writer's NoSpaceLeft or a bare ENOSPC) restated for `out`; None otherwise."""
    if isinstance(exc, NoSpaceLeft):
        return NoSpaceLeft(out, exc.reason, exc.doing, exc.needed, cleaned=True)
    if not (isinstance(exc, OSError) and exc.errno in NO_SPACE):
        return None
    doing = f"writing {Path(exc.filename).name}" if exc.filename else "writing it"
    return NoSpaceLeft(out, exc.strerror, doing, _needed(size, _allocated(tmp)), cleaned=True)


def _needed(size: int | None, written: int) -> int:
    """What an output of `size` tensor bytes still needs once `written` bytes are on disk
    (unknown size: at least a MiB more)."""
    if size is None:
        return 2**20
    return max(int(size * SPACE_MARGIN) + 2**20 - written, 2**20)


def _allocated(root: Path) -> int:
    """Bytes the files under `root` occupy (pre-sized shards count only what was written)."""
    return sum(p.lstat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


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


def fsync_path(path: Path) -> None:
    """Make a file's bytes, or a directory's entries (renames, new files), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_path  # a directory's entries: what its callers mean


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first."""
    for parent, _, files in sorted(os.walk(root), key=lambda e: -e[0].count(os.sep)):
        for name in files:
            fsync_path(Path(parent) / name)
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
