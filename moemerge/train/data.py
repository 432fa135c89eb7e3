"""Training text → fixed-length token blocks, one domain label per file, a held-out split.

Sources: a .txt file (one document), a .jsonl file (one document per line, its `text_field`),
a directory of those (each file its own domain, labelled by its stem), `name=path` (everything
under path gets domain `name`), or what the `datasets` package loads (needs it installed): a
directory written by `save_to_disk` (its train split, or its only one), or a hub id (org/name).
Each domain's documents are tokenised without special tokens, joined with EOS, and cut into
non-overlapping blocks of seq_len + 1 tokens (input seq_len, target shifted by one); the tail
that does not fill a block is dropped.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from moemerge.errors import RecipeError

TEXT_SUFFIXES = {".txt", ".md", ".text"}
JSONL_SUFFIXES = {".jsonl", ".json"}
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass
class Blocks:
    """Token blocks [N, seq_len + 1] of all domains, with domain index per block and split."""

    tokens: torch.Tensor  # [N, seq_len + 1] int64
    domain: torch.Tensor  # [N] index into `domains`
    domains: list[str]
    train_ids: torch.Tensor  # [N_train] block indices
    eval_ids: torch.Tensor  # [N_eval]


def _documents(path: Path, text_field: str) -> list[str]:
    if path.suffix in JSONL_SUFFIXES:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise RecipeError(f"{path}: not UTF-8 text (byte {exc.start}); JSON Lines files "
                              "must be UTF-8") from None
        docs = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)[text_field]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise RecipeError(
                    f"{path}:{n}: not a JSON object with a {text_field!r} field (--text-field)"
                ) from None
            except RecursionError:
                raise RecipeError(f"{path}:{n}: the JSON is nested too deeply") from None
            docs.append(str(doc))
        return docs
    return [path.read_text(encoding="utf-8", errors="replace")]


SAVED_DATASET = ("dataset_info.json", "dataset_dict.json")  # written by save_to_disk


def _dataset_documents(name: str, text_field: str, *, saved: bool) -> list[str]:
    """The `text_field` of every row of a saved dataset directory or a hub dataset."""
    what = "a saved dataset" if saved else "not a local file or directory; a hub dataset"
    if importlib.util.find_spec("datasets") is None:
        raise RecipeError(f"data {name!r}: {what}: loading it needs the 'datasets' package "
                          "(pip install datasets)")
    import datasets

    try:
        rows = datasets.load_from_disk(name) if saved else datasets.load_dataset(name)
        if isinstance(rows, datasets.DatasetDict):  # the train split, or the only one
            if "train" not in rows and len(rows) != 1:
                raise ValueError(f"no 'train' split among {', '.join(rows)}")
            rows = rows["train"] if "train" in rows else next(iter(rows.values()))
        if text_field not in rows.column_names:
            raise ValueError(f"no {text_field!r} column (--text-field) among "
                             f"{', '.join(rows.column_names)}")
        return [str(text) for text in rows[text_field]]
    except Exception as exc:  # any failure to load is this source's fault
        raise RecipeError(f"data {name!r}: cannot load it with datasets: {exc}") from None


def collect_texts(sources: list[str], text_field: str) -> dict[str, list[str]]:
    """{domain: documents} from the `data` entries, in the order given."""
    texts: dict[str, list[str]] = {}
    for source in sources:
        name, sep, where = source.partition("=")
        label, path = (name, Path(where)) if sep and name else (None, Path(source))
        if not path.exists():
            if HUB_ID.match(str(path)):
                texts.setdefault(label or str(path), []).extend(
                    _dataset_documents(str(path), text_field, saved=False))
                continue
            raise RecipeError(f"data {source!r}: {path} does not exist")
        if path.is_dir() and any((path / marker).is_file() for marker in SAVED_DATASET):
            texts.setdefault(label or path.name, []).extend(
                _dataset_documents(str(path), text_field, saved=True))
            continue
        suffixes = TEXT_SUFFIXES | JSONL_SUFFIXES
        files = [path] if path.is_file() else sorted(
            p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
        if not files:
            raise RecipeError(f"data {source!r}: no .txt or .jsonl files in {path}")
        for file in files:
            texts.setdefault(label or file.stem, []).extend(_documents(file, text_field))
    return texts


def make_blocks(texts: dict[str, list[str]], tokenizer, seq_len: int,
                eval_fraction: float) -> Blocks:
    """Tokenise each domain and cut it into blocks; every k-th block (evenly spread, the same
    for any seed) is held out, at least one per domain when eval_fraction > 0."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    rows, labels, held = [], [], []
    for d, (domain, docs) in enumerate(texts.items()):
        ids: list[int] = []
        for doc in docs:
            ids += tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"] + eos
        n = len(ids) // (seq_len + 1)
        need = 2 if eval_fraction > 0 else 1
        if n < need:
            raise RecipeError(
                f"data for domain {domain!r}: {len(ids)} tokens make {n} block(s) of "
                f"seq_len + 1 = {seq_len + 1} tokens; need at least {need} (more text, or a "
                "smaller --seq-len)")
        block = torch.tensor(ids[: n * (seq_len + 1)], dtype=torch.long).view(n, seq_len + 1)
        n_eval = max(1, round(n * eval_fraction)) if eval_fraction > 0 else 0
        n_eval = min(n_eval, n - 1)
        # block i is held out when floor(i·n_eval/n) steps up: n_eval blocks spread evenly
        is_eval = [math.floor((i + 1) * n_eval / n) > math.floor(i * n_eval / n) for i in range(n)]
        rows.append(block)
        labels += [d] * n
        held += is_eval
    held_t = torch.tensor(held)
    return Blocks(
        tokens=torch.cat(rows), domain=torch.tensor(labels), domains=list(texts),
        train_ids=torch.nonzero(~held_t).flatten(), eval_ids=torch.nonzero(held_t).flatten())


@lru_cache(maxsize=4)
def _epoch_order(seed: int, n: int, epoch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=gen)  # [n]


def global_batch(train_ids: torch.Tensor, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """The block indices of optimizer step `step` (0-based): positions [step·B, (step+1)·B) of
    the stream of per-epoch permutations seeded by (seed, epoch). A pure function of the step,
    so a resumed run reads exactly the data the uninterrupted one would."""
    n = len(train_ids)
    picks = []
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(pos, n)
        picks.append(train_ids[_epoch_order(seed, n, epoch)[i]])
    return torch.stack(picks)  # [B]
