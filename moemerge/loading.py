"""Loading a model, tokenizer or config through transformers under moemerge's rules."""

from __future__ import annotations

from pathlib import Path

from moemerge.io.reader import check_model_dir_confined
from moemerge.modeling import register


def load_pretrained(auto_class: str, path, *, trust_remote_code: bool = False, **kwargs):
    """`transformers.<auto_class>.from_pretrained(path)` under moemerge's rules: its own kinds
    with the installed code, no Python from the model directory unless `trust_remote_code`
    (passed explicitly, so transformers never asks on stdin), no file from outside a local
    model directory (CheckpointError: an index entry or a symlink pointing out), and every
    other failure to load as an OSError or ValueError (a malformed tokenizer.json raises the
    tokenizers library's own exception class) for the caller to report."""
    import transformers

    if Path(path).is_dir():
        check_model_dir_confined(Path(path))
    register()
    try:
        return getattr(transformers, auto_class).from_pretrained(
            path, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError):
        raise
    except Exception as exc:  # whatever a broken file makes a loader raise
        raise ValueError(f"{type(exc).__name__}: {str(exc)[:500]}") from exc
