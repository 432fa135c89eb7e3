"""A model reference is a local directory or a Hugging Face hub id; resolve it to a directory."""

from __future__ import annotations

import os
import re
from pathlib import Path

from moemerge.errors import CheckpointError

# `name` or `org/name`: what the hub accepts as a repo id (letters, digits, - _ .)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
# what a model directory needs; never the other weight formats a hub repo may also carry
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.py"]


def offline() -> bool:
    """Whether HF_HUB_OFFLINE asks for the cache only."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


# a name ending like a file (`r.yaml`, `model.safetensors`) was meant as a path, not a repo
FILE_SUFFIXES = (".yaml", ".yml", ".json", ".jsonl", ".txt", ".safetensors", ".bin", ".pt",
                 ".pth", ".gguf", ".py", ".md")


def looks_like_path(ref: str, near: tuple[Path, ...] = ()) -> bool:
    """A reference the user meant as a path: never sent to the hub. That is one starting with
    `.`, `/` or `~`, with more than one `/`, ending like a file name, or whose first part names
    an existing directory (here or in one of `near`, e.g. the recipe's directory)."""
    first = ref.split("/", 1)[0]
    return (ref.startswith((".", "/", "~")) or ref.count("/") > 1 or "\\" in ref
            or not HUB_ID.fullmatch(ref) or ref.lower().endswith(FILE_SUFFIXES)
            or any((Path(d) / first).exists() for d in (Path.cwd(), *near)))


def resolve_model(ref: str, revision: str | None = None, near: tuple[Path, ...] = ()) -> Path:
    """The local directory holding `ref`: the directory itself, or a hub snapshot (downloaded
    unless HF_HUB_OFFLINE is set, in which case only the local cache is consulted)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists():
        raise CheckpointError(f"model {ref} is a file; a model is a directory (config.json, "
                              "weights, tokenizer) or a hub id")
    if looks_like_path(ref, near):
        raise CheckpointError(f"model directory {ref} does not exist")
    from huggingface_hub import snapshot_download  # slow import, only for hub ids

    where = ref + (f" (revision {revision})" if revision else "")
    try:
        return Path(snapshot_download(ref, revision=revision, allow_patterns=HUB_PATTERNS,
                                      local_files_only=offline()))
    except Exception as exc:  # hub errors come in many classes; each means "not available"
        if offline():
            raise CheckpointError(
                f"{where} is not a local directory and not in the Hugging Face cache, and "
                f"HF_HUB_OFFLINE is set (offline mode). Download it first with `hf download "
                f"{ref}` on a machine with network access, or give a local path."
            ) from None
        raise CheckpointError(
            f"{where} is not a local directory and could not be fetched from the Hugging Face "
            f"hub ({type(exc).__name__}: {_first_line(exc)}). Check the id and your network or "
            "token, "
            "download it with `hf download`, or give a local path."
        ) from None


def _first_line(exc: Exception, limit: int = 160) -> str:
    """The first line of a hub library's error, cut at `limit` characters: its message goes
    on for paragraphs of advice that are not about moemerge's input."""
    line = next((part for part in str(exc).splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[:limit - 1] + "…"
