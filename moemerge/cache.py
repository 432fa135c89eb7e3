"""$MOEMERGE_CACHE (default ~/.cache/moemerge): what moemerge makes once and reuses (toy and real
expert sets, converted bases, the compiled merge kernel), and the one rule for reading it back.

A cache is only as trustworthy as the least trusted person who could write to it: a library
planted there runs as soon as it is loaded, and a planted toy set would be merged as if moemerge
had made it. So everything read back from the cache goes through `check_trusted` (a directory,
the compiled kernel) or `check_entry` (a made entry, file by file), and is used only when it
and every directory above it are the user's own:

- the path, symlinks resolved, is owned by this user and writable by nobody else;
- every directory above it is owned by this user or root and writable by nobody else, unless
  it is sticky (/tmp: others cannot rename or remove what is ours there);
- inside an entry, no symlinks, and every file and directory is the user's own, writable by
  nobody else.

The directories moemerge creates in the cache are created with mode 0700 (`private_dir`).
Nothing in the cache is unpickled; the kernel is the one thing in it that is executed, and it
is loaded only after its digest matches the one recorded when moemerge compiled it
(merge/native).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from moemerge.errors import CacheError

ENV = "MOEMERGE_CACHE"


def cache_root() -> Path:
    """$MOEMERGE_CACHE, else ~/.cache/moemerge (absolute: a relative $MOEMERGE_CACHE is taken
    against the working directory once, here, not wherever a later call runs)."""
    return Path(os.environ.get(ENV) or Path.home() / ".cache" / "moemerge").absolute()


def private_dir(*parts: str, root: Path | None = None) -> Path:
    """`root` (default the cache root) / parts, each missing directory created with mode 0700,
    and checked (`check_trusted`); nothing is created below a directory others could write. A
    directory of moemerge's own below the root (owned by the user) that others may read but
    not write is made 0700; one they could have written is refused, not repaired."""
    top = Path(root) if root is not None else cache_root()
    path = top.joinpath(*parts)
    existing = next(p for p in (path, *path.parents) if os.path.lexists(p))
    if existing != path and (reason := _above_problem(existing.resolve())) is not None:
        raise CacheError(_refusal(path, reason))
    for directory in reversed([p for p in (path, *path.parents) if not os.path.lexists(p)]):
        directory.mkdir(mode=0o700, exist_ok=True)
    for depth in range(len(parts)):
        _tighten(top.joinpath(*parts[: depth + 1]))
    return check_trusted(path)


def _tighten(path: Path) -> None:
    st = path.lstat()
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and \
            stat.S_IMODE(st.st_mode) & 0o077 and not st.st_mode & 0o022:
        path.chmod(0o700)


def untrusted_reason(path: Path) -> str | None:
    """Why someone other than this user could have written `path` (a file or directory of the
    cache, resolved), or None when only the user (and root) could."""
    me = os.geteuid()
    try:
        real = Path(path).resolve(strict=True)
        st = real.stat()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        return f"it cannot be resolved ({exc})"
    shown = f"{real}" + (f" (where {path} leads)" if real != Path(path).absolute() else "")
    if st.st_uid != me:
        return f"{shown} is owned by uid {st.st_uid}, not by this user (uid {me})"
    if st.st_mode & 0o022:
        return f"{shown} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return _above_problem(real.parent)


def _above_problem(directory: Path) -> str | None:
    """Why `directory` (resolved) or one above it lets others replace what is below it: not
    owned by this user or root, or writable by others without being sticky; or None."""
    me = os.geteuid()
    for parent in (directory, *directory.parents):
        st = parent.stat()
        if st.st_uid not in (me, 0):
            return f"{parent}, above it, is owned by uid {st.st_uid}, not by this user or root"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (f"{parent}, above it, is writable by others and not sticky (mode "
                    f"{stat.S_IMODE(st.st_mode):o}): they could replace what is below it")
    return None


def check_trusted(path: Path) -> Path:
    """`path`, or a CacheError saying why it is not used."""
    if (reason := untrusted_reason(path)) is not None:
        raise CacheError(_refusal(path, reason))
    return path


def check_entry(entry: Path) -> Path:
    """A made cache entry (a directory): trusted itself, and every file and directory in it the
    user's own, writable by nobody else, none of them a symlink. A CacheError otherwise."""
    check_trusted(entry)
    me = os.geteuid()
    for top, dirs, files in os.walk(entry):
        for name in dirs + files:
            item = Path(top, name)
            st = item.lstat()
            if stat.S_ISLNK(st.st_mode):
                raise CacheError(_refusal(entry, f"{item} is a symlink"))
            if st.st_uid != me or st.st_mode & 0o022:
                raise CacheError(_refusal(entry, f"{item} is owned by uid {st.st_uid} with "
                                          f"mode {stat.S_IMODE(st.st_mode):o}: others could "
                                          "have written it"))
    return entry


def seal(entry: Path) -> None:
    """Take group and other write permission off everything in a newly made entry (a umask of
    002 would give them), so that `check_entry` accepts what moemerge made itself."""
    for top, dirs, files in os.walk(entry):
        for name in dirs + files:
            item = Path(top, name)
            st = item.lstat()
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o022:
                item.chmod(stat.S_IMODE(st.st_mode) & ~0o022)
    entry.chmod(stat.S_IMODE(entry.stat().st_mode) & ~0o022)


def _refusal(path: Path, reason: str) -> str:
    return (f"the cache entry {path} is not used: {reason}. moemerge reads back only what "
            f"nobody else could have written; set ${ENV} to a directory of your own (it is "
            "created with mode 0700), or remove this one")
