"""Loading a model, tokenizer or config through transformers under moemerge's rules."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moemerge.errors import CheckpointError, RecipeError
from moemerge.io.atomic import RECIPE_COPY
from moemerge.io.paths import confined
from moemerge.io.reader import check_model_dir_confined
from moemerge.modeling import register
from moemerge.recipe.load import safe_yaml


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' own tqdm bars ("Loading weights", writing shards) while rich shows
    ours, or none."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def load_pretrained(auto_class: str, path, *, trust_remote_code: bool = False, **kwargs):
    """`transformers.<auto_class>.from_pretrained(path)` under moemerge's rules: its own kinds
    with the installed code, no Python from the model directory unless `trust_remote_code`
    (passed explicitly, so transformers never asks on stdin), no file from outside a local
    model directory (CheckpointError: an index entry or a symlink pointing out), no progress
    bar of transformers', and every other failure to load as an OSError or ValueError (a
    malformed tokenizer.json raises the tokenizers library's own exception class) for the
    caller to report."""
    import transformers

    if Path(path).is_dir():
        check_model_dir_confined(Path(path))
    register()
    try:
        with quiet_transformers():
            return getattr(transformers, auto_class).from_pretrained(
                path, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError):
        raise
    except Exception as exc:  # whatever a broken file makes a loader raise
        raise ValueError(f"{type(exc).__name__}: {str(exc)[:500]}") from exc


def load_causal_lm(path, *, what: str = "a causal LM", trust_remote_code: bool = False,
                   **kwargs):
    """(model in fp32, tokenizer) of `path`; a failure is a CheckpointError naming it."""
    import torch

    try:
        model = load_pretrained("AutoModelForCausalLM", path, dtype=torch.float32,
                                trust_remote_code=trust_remote_code, **kwargs)
        tokenizer = load_pretrained("AutoTokenizer", path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot load {what} and its tokenizer from {path}: {exc}") from None
    return model, tokenizer


def read_recipe_copy(model_dir: Path | str) -> dict:
    """The recipe `build` copied into `model_dir` (kept through `finetune`), as a mapping; {}
    when there is none, or it is not YAML of a mapping: what callers read from it (expert
    names, the recipe's kind) only names or defaults things."""
    try:
        file = confined(Path(RECIPE_COPY), Path(model_dir), "recipe copy")
        recipe = safe_yaml(file.read_text(), RECIPE_COPY)
    except (OSError, UnicodeDecodeError, ValueError, RecipeError):
        return {}
    return recipe if isinstance(recipe, dict) else {}
