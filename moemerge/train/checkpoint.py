"""Resumable training state in OUT.checkpoints/step-N/, each written whole or not at all.

A checkpoint holds what changes during training and nothing else: the trainable parameters,
the optimizer and scheduler states, the RNG states, the step (the data position: batches are a
pure function of the step) and the metrics so far. Resuming on CPU retraces the uninterrupted
run bit for bit.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

import torch

from moemerge.errors import CheckpointError, RecipeError

STATE = "state.pt"


def checkpoint_root(out: Path) -> Path:
    return Path(f"{Path(out)}.checkpoints")


def latest(root: Path) -> Path | None:
    """The finished checkpoint with the highest step, if any (temporary dirs start with '.')."""
    found = [(int(p.name[5:]), p) for p in root.glob("step-*")
             if p.name[5:].isdigit() and (p / STATE).is_file()] if root.is_dir() else []
    return max(found)[1] if found else None


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
    tmp = Path(tempfile.mkdtemp(prefix=f".step-{step}.tmp-", dir=root))
    final = root / f"step-{step}"
    try:
        torch.save({**state, "step": step}, tmp / STATE)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    steps = sorted(int(p.name[5:]) for p in root.glob("step-*") if p.name[5:].isdigit())
    for old in steps[:-keep]:
        shutil.rmtree(root / f"step-{old}", ignore_errors=True)
    return final


def load(path: Path, fingerprint: dict) -> dict:
    """A checkpoint's state, refused when it was made with different training settings."""
    try:
        state = torch.load(path / STATE, map_location="cpu", weights_only=False)
    except Exception as exc:  # a truncated or foreign file
        raise CheckpointError(f"{path / STATE}: cannot load the checkpoint: {exc}") from None
    if state.get("fingerprint") != fingerprint:
        theirs = state.get("fingerprint") or {}
        diff = sorted(k for k in fingerprint if theirs.get(k) != fingerprint[k])
        raise RecipeError(f"--resume: {path} was made with different settings ({', '.join(diff)})"
                          "; use the same ones, or start afresh without --resume")
    return state
