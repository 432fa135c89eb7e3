"""Text → fixed-length token blocks, one domain label per block, a held-out split (what
`finetune` trains on and `router.init: calibrate` fits routers on).

The `data` entries are read by moemerge.data (docs/data.md). Each domain's documents are
tokenised without special tokens, joined with EOS, and cut into non-overlapping blocks of
seq_len + 1 tokens (input seq_len, target shifted by one); the tail that does not fill a block
is dropped. A domain given with a held-out part (`code.eval.txt` beside `code.train.txt`) is
evaluated on that part's blocks only and trained on the rest; the others hold out every k-th
block (eval_fraction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from moemerge.data import Domain
from moemerge.errors import RecipeError


@dataclass
class Blocks:
    """Token blocks [N, seq_len + 1] of all domains, with domain index per block and split."""

    tokens: torch.Tensor  # [N, seq_len + 1] int64
    domain: torch.Tensor  # [N] index into `domains`
    domains: list[str]
    train_ids: torch.Tensor  # [N_train] block indices
    eval_ids: torch.Tensor  # [N_eval]


def _blocks(docs: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """[n, seq_len + 1]: the documents tokenised, joined with EOS, cut; the tail dropped."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for doc in docs:
        ids += tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"] + eos
    n = len(ids) // (seq_len + 1)
    return torch.tensor(ids[: n * (seq_len + 1)], dtype=torch.long).view(n, seq_len + 1)


def make_blocks(texts: dict[str, Domain | list[str]], tokenizer, seq_len: int,
                eval_fraction: float) -> Blocks:
    """Tokenise each domain and cut it into blocks. A domain with a held-out part is evaluated
    on its blocks; otherwise every k-th block (evenly spread, the same for any seed) is held
    out, at least one per domain when eval_fraction > 0."""
    rows, labels, held = [], [], []
    for d, (name, domain) in enumerate(texts.items()):
        if not isinstance(domain, Domain):
            domain = Domain(name, documents=list(domain))
        train = _blocks(domain.documents, tokenizer, seq_len)
        if domain.held_out:
            evals = _blocks(domain.held_out, tokenizer, seq_len)
            parts = [(train, 1, "its training files"), (evals, 1, "its held-out files")]
            is_eval = [False] * len(train) + [True] * len(evals)
            block = torch.cat([train, evals])
        else:
            need = 2 if eval_fraction > 0 else 1
            parts = [(train, need, "its text")]
            n = len(train)
            n_eval = min(max(1, round(n * eval_fraction)) if eval_fraction > 0 else 0, n - 1)
            # block i is held out when floor(i·n_eval/n) steps up: n_eval blocks spread evenly
            is_eval = [math.floor((i + 1) * n_eval / n) > math.floor(i * n_eval / n)
                       for i in range(n)]
            block = train
        for part, need, what in parts:
            if len(part) < need:
                raise RecipeError(
                    f"data for domain {name!r}: {what} make {len(part)} block(s) of seq_len + 1 "
                    f"= {seq_len + 1} tokens; need at least {need} (more text, or a smaller "
                    "--seq-len)")
        rows.append(block)
        labels += [d] * len(block)
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
