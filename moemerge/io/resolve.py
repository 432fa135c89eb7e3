"""A model reference is a local directory or a Hugging Face hub id; resolve it to a directory."""

from __future__ import annotations

import os
import re
from pathlib import Path

from moemerge.errors import CheckpointError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
# what a model directory needs; never the other formats a hub repo may also carry
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.py"]


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_model(ref: str, revision: str | None = None) -> Path:
    """The local directory holding `ref`, downloading a hub id unless offline."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path.resolve()
    looks_like_path = ref.startswith((".", "/", "~")) or ref.count("/") > 1 or "\\" in ref
    if looks_like_path or not HUB_ID.fullmatch(ref):
        raise CheckpointError(f"model directory {ref} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(ref, revision=revision, allow_patterns=HUB_PATTERNS,
                                      local_files_only=offline()))
    except Exception as exc:  # hub errors have many classes; each means "not available"
        where = f"{ref}" + (f" (revision {revision})" if revision else "")
        if offline():
            raise CheckpointError(
                f"{where} is not a local directory and not in the Hugging Face cache, and "
                "HF_HUB_OFFLINE is set. Download it first (`hf download "
                f"{ref}`) or give a local path."
            ) from None
        raise CheckpointError(
            f"{where} is not a local directory and could not be fetched from the Hugging Face "
            f"hub: {type(exc).__name__}: {exc}"
        ) from None
