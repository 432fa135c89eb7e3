"""Loading a model, tokenizer or config through transformers under moemerge's rules."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moemerge.errors import CheckpointError, MismatchError, RecipeError
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
        if auto_class.startswith("AutoModel"):
            check_form_loads(Path(path), transformers.__version__)
    register()
    try:
        with quiet_transformers():
            return getattr(transformers, auto_class).from_pretrained(
                path, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError):
        raise
    except Exception as exc:  # whatever a broken file makes a loader raise
        raise ValueError(f"{type(exc).__name__}: {str(exc)[:500]}") from exc


def check_form_loads(path: Path, version: str) -> None:
    """An MoE stored in transformers 5's fused form, on a transformers 4 that would load it
    with its experts missing (random): a CheckpointError saying so, before the load."""
    if int(version.split(".")[0]) >= 5 or not (path / "config.json").is_file():
        return
    from moemerge.architectures.forms import FUSED
    from moemerge.io.reader import CheckpointReader

    try:
        with CheckpointReader(path) as reader:
            form = reader.form
    except CheckpointError:  # (a pickle, a broken file: the load itself says what is wrong)
        return
    if form == FUSED:
        raise CheckpointError(
                f"{path} stores its experts in transformers 5's fused form (experts.gate_up_proj "
                f"stacks), which transformers {version} cannot load; upgrade transformers, or "
                "use a copy in the classic form (what save_pretrained writes)")


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
    check_tokenizer_fits(tokenizer, vocab_rows(model), path, path)
    return model, tokenizer


def vocab_rows(model) -> int | None:
    """The rows of a model's input embedding: a loaded model's own, else its config's
    `vocab_size` (a config.json dict or a transformers config; a multimodal config's
    `text_config`'s); None where neither says."""
    embed = None
    if hasattr(model, "get_input_embeddings"):
        try:
            embed = model.get_input_embeddings()
        except (NotImplementedError, AttributeError):
            embed = None
    weight = getattr(embed, "weight", None)
    if weight is not None and getattr(weight, "ndim", 0) == 2:
        return int(weight.shape[0])
    config = getattr(model, "config", model)
    for part in (config, _get(config, "text_config")):
        rows = _get(part, "vocab_size")
        if isinstance(rows, int) and not isinstance(rows, bool) and rows > 0:
            return rows
    return None


def _get(config, key: str):
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def check_tokenizer_fits(tokenizer, rows: int | None, tokenizer_dir, model) -> None:
    """Before any text is tokenized for `model`: every id the tokenizer can give (its added
    tokens' included) indexes a row of the model's embedding, `rows` (vocab_size);
    MismatchError naming the tokenizer's directory, its size and largest id and the rows
    otherwise (the first such token would make torch.embedding raise a bare IndexError in
    the middle of a forward pass). Nothing to check where `rows` is unknown."""
    if rows is None:
        return
    size = len(tokenizer)
    largest = max(tokenizer.get_vocab().values(), default=size - 1)
    if max(largest, size - 1) >= rows:
        own = str(tokenizer_dir) == str(model)
        where = (f"{model}: its tokenizer" if own else f"the tokenizer in {tokenizer_dir}")
        raise MismatchError(
            f"{where} has {size:,} tokens (largest id {largest:,}), but "
            f"{'its' if own else f'the embedding of {model}'}{' embedding' if own else ''} has "
            f"{rows:,} rows (vocab_size): ids from {rows:,} on cannot be embedded. Use the "
            "tokenizer saved with the model, or a model whose vocab_size covers the tokenizer")


def check_seq_len(length: int, option: str, model_config, model) -> None:
    """`length` tokens at once (a window, a block, a prompt) fit `model`'s positions: at most
    its config's max_position_embeddings where it has one (MAX_SEQ_LEN bounds it anyway, in
    each option's own check); RecipeError naming the option and the bound otherwise."""
    positions = _get(model_config, "max_position_embeddings")
    if positions is None:
        positions = _get(_get(model_config, "text_config") or {}, "max_position_embeddings")
    if isinstance(positions, int) and not isinstance(positions, bool) and 0 < positions < length:
        raise RecipeError(f"{option}: {length:,} tokens at once, more than the "
                          f"{positions:,} positions of {model} (max_position_embeddings); "
                          f"give at most {positions:,}")


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
