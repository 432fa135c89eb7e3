"""Resumable training state in OUT.checkpoints/step-N/, each written whole or not at all.

A checkpoint holds what changes during training and nothing else: the trainable parameters,
the optimizer and scheduler states, the RNG states, the step (the data position: batches are a
pure function of the step) and the metrics so far. Resuming on CPU retraces the uninterrupted
run bit for bit.

Loading never unpickles objects (`weights_only=True`: tensors, numbers, strings and plain
containers only), so a crafted state.pt cannot run code. Each checkpoint is fsynced (file,
then directory) before it is renamed into place; a latest one that is unreadable anyway (a
crash on a file system that lies about fsync, a copy cut short) is skipped with a warning for
the one before it.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from moemerge.errors import CheckpointError, OutputError, RecipeError
from moemerge.io.atomic import (
    NO_SPACE,
    NoSpaceLeft,
    deferred_signals,
    fsync_dir,
    fsync_tree,
    owned_tempdir,
    space_needed,
    sweep_stale,
)

STATE = "state.pt"


def checkpoint_root(out: Path) -> Path:
    return Path(f"{Path(out)}.checkpoints")


TMP_PREFIX = ".step-*.tmp-"  # .step-N.tmp-<pid>-XXXX: the owner's pid, for the sweep


def finished(root: Path) -> list[Path]:
    """The finished checkpoints, highest step first (temporary dirs start with '.')."""
    found = [(int(p.name[5:]), p) for p in root.glob("step-*")
             if p.name[5:].isdigit() and (p / STATE).is_file()] if root.is_dir() else []
    return [p for _, p in sorted(found, reverse=True)]


def latest(root: Path) -> Path | None:
    """The finished checkpoint with the highest step, if any."""
    found = finished(root)
    return found[0] if found else None


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(root: Path, step: int, state: dict, keep: int) -> Path:
    """Write step-`step` atomically (temp dir, then rename) and keep only the last `keep`."""
    root.mkdir(parents=True, exist_ok=True)
    sweep_stale(root, TMP_PREFIX)  # left by a killed run
    final, tmp = root / f"step-{step}", None
    try:
        with deferred_signals():  # Ctrl-C / SIGTERM land once `tmp` is known, inside this try
            tmp = owned_tempdir(root, f".step-{step}.tmp-")
        torch.save({**state, "step": step}, tmp / STATE)
        fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_dir(root)
    except BaseException as exc:
        failed = _write_error(final, exc, state)  # before the cleanup frees what was written
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if not any(root.iterdir()):  # made for this checkpoint
            root.rmdir()
        if failed is not None:
            raise failed from None
        raise
    steps = sorted(int(p.name[5:]) for p in root.glob("step-*") if p.name[5:].isdigit())
    for old in steps[:-keep]:
        shutil.rmtree(root / f"step-{old}", ignore_errors=True)
    return final


def _write_error(final: Path, exc: BaseException, state: dict) -> OutputError | None:
    """A clean error for a checkpoint that could not be written (torch.save reports a full
    disk as a RuntimeError), naming it and the space it needs against the space free."""
    if isinstance(exc, OSError) and exc.errno not in NO_SPACE:
        return OutputError(f"cannot write the checkpoint {final}: {exc.strerror or exc}")
    if isinstance(exc, OSError):
        return NoSpaceLeft(final, exc.strerror, "saving the training state", state_bytes(state),
                           cleaned=True)
    if isinstance(exc, RuntimeError):
        return OutputError(f"cannot write the checkpoint {final} ({str(exc)[:200]}); "
                           f"{space_needed(final, state_bytes(state))}; nothing was left behind")
    return None


def state_bytes(state: object) -> int:
    """Bytes of the tensors in a (nested) training state."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v) for v in state)
    return 0


def load_latest(root: Path, fingerprint: dict,
                warn: Callable[[str], None]) -> tuple[Path, dict] | None:
    """(path, state) of the newest checkpoint that loads, `warn`ing about each newer one that
    does not; None when there is none. Different training settings are an error, not a skip."""
    failures = []
    for path in finished(root):
        try:
            return path, load(path, fingerprint)
        except CheckpointError as exc:
            failures.append(str(exc))
            warn(f"{exc}; falling back to the checkpoint before it")
    if failures:
        raise CheckpointError(f"--resume: no checkpoint in {root} can be loaded "
                              f"({len(failures)} tried; the latest: {failures[0]}); start "
                              "afresh without --resume")
    return None


def _reason(exc: Exception) -> str:
    """torch's refusal without its advice to retry with weights_only=False."""
    text = str(exc)
    if text.startswith("Weights only load failed"):  # the why is the first line after advice
        found = [line for line in text.splitlines()[1:] if line.strip()][:1] or [""]
        return f"it holds pickled objects, which moemerge never loads ({found[0][:200]})"
    return f"the file is truncated or corrupt ({text[:200]})"


def load(path: Path, fingerprint: dict) -> dict:
    """A checkpoint's state, refused when it was made with different training settings."""
    try:  # never unpickle objects: a crafted state.pt could run code
        state = torch.load(path / STATE, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ValueError("not a moemerge training state")
    except Exception as exc:  # a truncated, foreign or crafted file
        raise CheckpointError(f"{path / STATE}: cannot load the checkpoint: "
                              f"{_reason(exc)}") from None
    if state.get("fingerprint") != fingerprint:
        theirs = state.get("fingerprint") or {}
        diff = sorted(k for k in fingerprint if theirs.get(k) != fingerprint[k])
        raise RecipeError(f"--resume: {path} was made with different settings ({', '.join(diff)})"
                          "; use the same ones, or start afresh without --resume")
    return state
