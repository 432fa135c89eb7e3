"""Where files may be: inputs stay inside their model directory, outputs stay apart from inputs.

Both rules compare real paths (symlinks resolved), so a link cannot smuggle a file in or an
output on top of an input.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path

from moemerge.errors import CheckpointError, RecipeError


def real(path: Path | str) -> Path:
    """The absolute path with every symlink resolved (the missing tail kept as written)."""
    return Path(os.path.realpath(Path(path).expanduser()))


def within(path: Path, root: Path) -> bool:
    """Whether real path `path` is `root` or below it (both already real)."""
    return path == root or root in path.parents


def hub_blob_store(directory: Path) -> Path | None:
    """The blob store of a Hugging Face cache snapshot `…/models--org--name/snapshots/<rev>`:
    its files are symlinks into `…/models--org--name/blobs`, which is allowed explicitly."""
    snapshots = directory.parent
    repo = snapshots.parent
    if snapshots.name == "snapshots" and repo.name.startswith(("models--", "datasets--")):
        return real(repo / "blobs")
    return None


def confined(file: Path, directory: Path, what: str = "file") -> Path:
    """`file` (absolute, or relative to `directory`: a name in it, never a path that already
    starts with a relative `directory`, which would be joined twice and miss every link) with
    its links resolved, if it stays inside `directory` (or the hub blob store of a snapshot);
    CheckpointError naming both otherwise, or naming `file` when it is a symlink loop. Returns
    `directory / file`."""
    _not_a_loop(Path(directory) / file, directory)
    root = real(directory)
    target = real(Path(directory) / file)
    allowed = [root] + [b for b in (hub_blob_store(Path(directory).absolute()),
                                    hub_blob_store(root)) if b is not None]
    if not any(within(target, r) for r in allowed):
        raise CheckpointError(f"{what} {file} of {directory} resolves to {target}, outside the "
                              "model directory; refused (a model directory must not point "
                              "elsewhere)")
    return Path(directory) / file


def _not_a_loop(path: Path, directory: Path) -> None:
    """realpath() stops quietly at a symlink loop (and `is_file()` says False): refuse it by
    name instead of reading the directory as if the file were missing."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointError(f"{path} is a symlink loop (its links lead back to "
                                  f"themselves) in the model directory {directory}; "
                                  "refused") from None


def check_no_link_loops(directory: Path) -> None:
    """No symlink under model directory `directory` is a loop (CheckpointError naming it):
    checked when the directory is opened, whichever of its files are read."""
    for parent, dirs, files in os.walk(directory):  # links are not followed
        for name in dirs + files:
            if os.path.islink(os.path.join(parent, name)):
                _not_a_loop(Path(parent) / name, directory)


def check_tree_confined(tree: Path, directory: Path) -> None:
    """Every entry under `tree` (a directory to be copied, or a file; as the caller has it,
    e.g. `model/extras`) stays inside `directory`."""
    tree = Path(tree).absolute()  # not joined to a relative `directory` a second time
    confined(tree, directory, "directory" if tree.is_dir() else "file")
    for parent, dirs, files in os.walk(tree):  # links are not followed; each is checked
        for name in dirs + files:
            confined(Path(parent) / name, directory)


def check_output_apart(out: Path, inputs: Iterable[tuple[str, Path]], *,
                       contained: Iterable[tuple[str, Path]] = ()) -> None:
    """Refuse (exit 2, before anything is read) an output that would replace or write into an
    input. `inputs` are (what, file or directory) that OUT must not equal, contain or sit
    inside (models, the recipe or config file, data); `contained` are (what, directory) that
    OUT must not equal or contain (the recipe's directory, the working directory): replacing
    OUT would delete them, while writing below them is fine."""
    target = real(out)
    for what, path in inputs:
        src = real(path)
        if within(target, src) or within(src, target):
            relation = ("is" if target == src else "is inside" if within(target, src)
                        else "contains")
            raise RecipeError(f"output {out} {relation} {what} {path}; moemerge never writes "
                              "into or replaces its inputs. Choose another output path.")
    for what, path in contained:
        if within(real(path), target):
            relation = "is" if real(path) == target else "contains"
            raise RecipeError(f"output {out} {relation} {what} {path}; replacing it would "
                              "delete that. Choose another output path.")


def working_directory() -> tuple[str, Path]:
    return "the working directory", Path.cwd()
