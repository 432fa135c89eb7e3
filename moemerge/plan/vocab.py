"""Vocabulary mapping for bridged experts with different tokenizers (docs/recipes.md).

The MoE keeps one tokenizer, the target (the recipe's `tokenizer:` expert). Every other
expert's embedding and head rows are re-indexed to the target's token ids by token string:
target token t (its string s in the target's vocabulary) takes the expert's row of s when the
expert has s ("shared" when the id is the same, "mapped" when it differs); when it lacks s, the
mean of the expert's rows of s's subword pieces under the expert's own tokenizer ("new"):
s split by the expert's subword model (its BPE merges on the same byte-level string), or, when
that model cannot spell s (another string convention), s decoded to text and encoded by the
expert's tokenizer. Target ids with no token (padding rows past the tokenizer) get zero rows.

The bridged plan reads such an expert's embedding and head through a `VocabRows` change:
[V_expert, d_expert] rows made [V_target, d_expert] in the execute loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moemerge.errors import CheckpointError, MismatchError, RecipeError
from moemerge.io.paths import confined
from moemerge.plan.jobs import Source
from moemerge.plan.sources import SourceModel, vocab_fingerprint

TOKENIZER_FILE = "tokenizer.json"


@dataclass(eq=False)  # hashed by identity: a change holds it
class VocabMap:
    """Expert rows making each target row: row t = mean of expert rows ids[offsets[t]:
    offsets[t + 1]] (an empty range is a zero row)."""

    ids: torch.Tensor  # [total pieces] expert token ids, long
    offsets: torch.Tensor  # [V_target] start of each target row's ids, long
    shared: int  # same string, same id
    mapped: int  # same string, another id
    new: int  # mean of the expert's pieces
    padding: int  # target ids with no token: zero rows

    @property
    def size(self) -> int:
        return len(self.offsets)

    def apply(self, rows: torch.Tensor, block: int = 8192) -> torch.Tensor:
        """[V_expert, d] expert rows -> [V_target, d] rows in target token order, in the rows'
        dtype (copied rows are exact; means are taken in float32), `block` target rows at a
        time: no float32 copy of a whole 150k-row matrix."""
        out = torch.empty(self.size, rows.shape[1], dtype=rows.dtype)
        ends = torch.cat([self.offsets[1:], torch.tensor([len(self.ids)])])
        for start in range(0, self.size, block):
            first = self.offsets[start].item()
            last = ends[min(start + block, self.size) - 1].item()
            pieces = rows[self.ids[first:last]].float()  # [pieces of this block, d]
            offsets = self.offsets[start: start + block] - first
            out[start: start + block] = F.embedding_bag(
                torch.arange(len(pieces)), pieces, offsets, mode="mean").to(rows.dtype)
        return out

    def describe(self, expert: str, target: str) -> str:
        pad = f", {self.padding} padding" if self.padding else ""
        return (f"vocabulary: expert {expert} has another tokenizer; its embedding and head "
                f"rows are mapped onto the {self.size} ids of the tokenizer of {target}: "
                f"{self.shared} shared, {self.mapped} mapped, {self.new} new{pad} (shared: the "
                "same token at the same id; mapped: the same token at another id; new: the mean "
                "of its rows of the token's pieces" + ("; padding: ids without a token, zero "
                                                        "rows)" if self.padding else ")"))


def load_tokenizer_file(model: SourceModel):
    """The fast tokenizer of `model` (tokenizer.json: data only, no code runs)."""
    from tokenizers import Tokenizer

    file = model.path / TOKENIZER_FILE
    if not file.is_file():
        raise RecipeError(f"tokenizer: mapping vocabularies onto another needs each model's "
                          f"{TOKENIZER_FILE}, but {file} ({model.label}) is missing; save the "
                          "model's fast tokenizer next to its weights")
    confined(file.relative_to(model.path), model.path)
    try:
        return Tokenizer.from_str(file.read_text())
    except Exception as exc:  # unreadable, not JSON, not a tokenizer
        raise CheckpointError(f"{file} is not a valid tokenizer file: {str(exc)[:200]}") from None


def _pieces(token: str, source, target) -> list[int]:
    """The expert (`source`) token ids that spell target token string `token`."""
    unk = getattr(source.model, "unk_token", None)
    unk_id = source.token_to_id(unk) if unk else None
    try:
        ids = [t.id for t in source.model.tokenize(token)]
    except Exception:  # a character its model has no symbol for
        ids = []
    if ids and unk_id not in ids:
        return ids
    return source.encode(target.decode([target.token_to_id(token)], skip_special_tokens=False),
                         add_special_tokens=False).ids


def build_map(target, source, size: int, rows: int, where: str) -> VocabMap:
    """Map onto `size` target ids the expert whose tokenizer is `source` and whose embedding
    has `rows` rows (`where` names it in errors)."""
    vocab = source.get_vocab(with_added_tokens=True)
    by_id = {i: s for s, i in target.get_vocab(with_added_tokens=True).items()}
    ids, offsets, counts = [], [], {"shared": 0, "mapped": 0, "new": 0, "padding": 0}
    for t in range(size):
        offsets.append(len(ids))
        token = by_id.get(t)
        if token is None:
            counts["padding"] += 1
            continue
        if token in vocab:
            ids.append(vocab[token])
            counts["shared" if vocab[token] == t else "mapped"] += 1
            continue
        pieces = _pieces(token, source, target)
        ids += pieces
        counts["new"] += 1
    bad = [i for i in ids if i >= rows]
    if bad:
        raise MismatchError(f"{where}: its tokenizer gives id {bad[0]}, but its embedding has "
                            f"only {rows} rows")
    return VocabMap(torch.tensor(ids, dtype=torch.long),
                    torch.tensor(offsets, dtype=torch.long), **counts)


@dataclass(frozen=True)
class VocabRows:
    """An expert's embedding or head rows in the kept vocabulary's order (a Source's change)."""

    vmap: VocabMap

    def apply(self, read: Callable[[], torch.Tensor]) -> torch.Tensor:
        return self.vmap.apply(read())

    def shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        return (self.vmap.size, *stored[1:])

    def dtype(self, stored: torch.dtype) -> torch.dtype:
        return stored

    def describe(self) -> str:
        return f"rows mapped to the kept vocabulary ({self.vmap.size})"


def _same_vocabulary(a: SourceModel, b: SourceModel) -> bool:
    if a.config.get("vocab_size") != b.config.get("vocab_size"):
        return False
    fa, fb = vocab_fingerprint(a.path), vocab_fingerprint(b.path)
    return fa is None or fb is None or fa == fb  # no tokenizer.json: assumed the same


def map_vocabularies(models: list[SourceModel], target: int
                     ) -> tuple[dict[int, VocabMap], list[str]]:
    """({model index: its map} for each expert whose vocabulary differs from models[target]'s,
    one note per mapped expert)."""
    ref, maps, notes = models[target], {}, []
    size = ref.config["vocab_size"]
    target_tok = None
    for i, model in enumerate(models):
        if model is ref or _same_vocabulary(ref, model):
            continue
        target_tok = target_tok or load_tokenizer_file(ref)
        embed = next(n for n, r in model.roles.items() if r.role == "embed")
        maps[i] = build_map(target_tok, load_tokenizer_file(model), size,
                            model.reader.meta(embed).shape[0], model.where())
        notes.append(maps[i].describe(model.where(), ref.where()))
    return maps, notes


def mapped_source(models: list[SourceModel], maps: dict[int, VocabMap], model: int,
                  tensor: str) -> Source:
    """A source of the plan; an embedding or head of a mapped expert reads through its map."""
    mapped = model in maps and models[model].roles[tensor].role in ("embed", "lm_head")
    return Source(model, tensor, change=VocabRows(maps[model]) if mapped else None)
