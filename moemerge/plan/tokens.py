"""The output vocabulary of a dense merge with a `tokenizer:` block (mergekit's tokenizer merge;
docs/recipes.md#the-output-vocabulary).

1. The output tokenizer: `base` (the base's, else the first model's), one model's, or `union`:
   the base's tokens at their own ids, then each token another model has and it lacks (model by
   model in recipe order, by each model's ids; special ones last, still special), appended as
   added tokens, as mergekit appends them; then the block's `tokens` it lacks. A model's tokens
   count up to its config's vocab_size (rows past it are padding).
2. Every merged model's embedding and head rows re-indexed to it by token string, [V_i, d] ->
   [V, d]. A token a model lacks takes, in that model: the block's source for it; else the row
   of the one model that has it; else the base's; else the mean of the rows of the models that
   have it (float32); zeros where none has it. With `force`, the block's source replaces every
   model's own row.
3. Rows appended up to pad_to_multiple_of, in each model the mean of its token rows.
The merge then runs over the aligned rows. The one difference from mergekit 0.1.5: it appends
a union's new tokens in the order of a hash map (so their ids change from run to run); here
they follow the models' own ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moemerge.errors import RecipeError
from moemerge.plan.sources import SourceModel
from moemerge.plan.vocab import load_tokenizer_file
from moemerge.recipe.models import MergeRecipe, TokenFrom


@dataclass(eq=False)  # hashed by identity: jobs hold it
class VocabularyAlignment:
    """How each model's rows become the output's [size, d] (module docstring)."""

    tokens: int  # tokens of the output vocabulary (rows before the padding)
    size: int  # rows written: tokens, padded up to pad_to_multiple_of
    rows: dict[int, torch.Tensor]  # plan model index -> [tokens] its row of each token, or -1
    zero: torch.Tensor  # output ids whose fill is a zero row
    own: dict[int, torch.Tensor]  # model -> output ids filled with that model's row of the token
    explicit: list[tuple[int, int, int]]  # (output id, model, that model's row) from `tokens`
    mean: torch.Tensor  # output ids filled with the mean over the models that have them
    forced: torch.Tensor  # output ids whose fill replaces every model's own row
    counts: dict[str, int] = field(default_factory=dict)

    def align(self, tensors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """{model: [V_model, d]} -> {model: [size, d]}, in each tensor's dtype."""
        first = next(iter(tensors.values()))
        fills = self._fills(tensors, first.shape[1:])
        filled = torch.zeros(self.tokens, dtype=torch.bool)
        for ids in (self.zero, self.mean, *self.own.values()):
            filled[ids] = True
        if self.explicit:
            filled[torch.tensor([e[0] for e in self.explicit])] = True
        out = {}
        for model, tensor in tensors.items():
            rows = self.rows[model]
            aligned = torch.zeros((self.size, *tensor.shape[1:]), dtype=tensor.dtype)
            has = rows >= 0
            has[self.forced] = False
            aligned[:self.tokens][has] = tensor[rows[has]]
            lacking = ~has & filled
            aligned[:self.tokens][lacking] = fills[lacking].to(tensor.dtype)
            if self.size > self.tokens:  # padding rows: the mean of the token rows
                aligned[self.tokens:] = aligned[:self.tokens].float().mean(0).to(tensor.dtype)
            out[model] = aligned
        return out

    def _fills(self, tensors: dict[int, torch.Tensor], shape) -> torch.Tensor:
        """[tokens, d] float32: the fill of every output id that has one (zeros elsewhere)."""
        fills = torch.zeros((self.tokens, *shape))
        for model, ids in self.own.items():
            fills[ids] = tensors[model][self.rows[model][ids]].float()
        for token, model, row in self.explicit:
            fills[token] = tensors[model][row].float()
        if len(self.mean):
            total, count = torch.zeros((len(self.mean), *shape)), torch.zeros(len(self.mean))
            for model, tensor in tensors.items():
                rows = self.rows[model][self.mean]
                has = rows >= 0
                total[has] += tensor[rows[has]].float()
                count[has] += 1
            fills[self.mean] = total / count.clamp(min=1).view(-1, *([1] * len(shape)))
        return fills

    def describe(self) -> str:
        return ("rows aligned to the output vocabulary of " + str(self.tokens) + " tokens ("
                + ", ".join(f"{v} {k}" for k, v in self.counts.items() if v)
                + (f"; padded to {self.size}" if self.size > self.tokens else "") + ")")


def output_vocabulary(recipe: MergeRecipe, models: list[SourceModel]
                      ) -> tuple[str, VocabularyAlignment]:
    """(the output tokenizer.json text, how each model's rows are aligned to it). models: the
    plan's, the base first when the recipe has one."""
    spec = recipe.tokenizer
    assert spec is not None
    index = {ref.model: i for i, ref in enumerate(recipe.plan_refs)}
    tokenizers = [load_tokenizer_file(m) for m in models]
    vocabs = [_vocabulary(t, m) for t, m in zip(tokenizers, models, strict=True)]
    source = index[spec.source] if spec.source not in ("union", "base") else 0
    if len(vocabs[source]) < tokenizers[source].get_vocab_size(with_added_tokens=True):
        raise RecipeError(f"tokenizer.source: the tokenizer of {models[source].where()} has "
                          f"tokens past its vocab_size ({models[source].config['vocab_size']}"
                          "), tokens with no row; moemerge does not cut a tokenizer down")
    out = _union(tokenizers[0], vocabs, tokenizers) if spec.source == "union" else \
        tokenizers[source]
    missing = [t for t in spec.tokens if out.token_to_id(t) is None]
    out.add_tokens(missing)
    vocab = out.get_vocab(with_added_tokens=True)
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise RecipeError(f"tokenizer: the output vocabulary's ids are not 0..{len(vocab) - 1} "
                          "(a tokenizer with gaps in its ids); moemerge cannot lay its rows out")
    return out.to_str(), _alignment(recipe, models, vocabs, vocab, index)


def _vocabulary(tokenizer, model: SourceModel) -> dict[str, int]:
    """The model's tokens that have rows (ids below its config's vocab_size)."""
    size = model.config["vocab_size"]
    return {t: i for t, i in tokenizer.get_vocab(with_added_tokens=True).items() if i < size}


def _union(base, vocabs: list[dict[str, int]], tokenizers: list):
    """The base tokenizer with every other model's tokens appended (module docstring)."""
    from tokenizers import Tokenizer

    out = Tokenizer.from_str(base.to_str())  # a copy
    have = set(out.get_vocab(with_added_tokens=True))
    added_tokens: dict[str, object] = {}  # each model's added tokens, first seen first
    for vocab, tokenizer in zip(vocabs, tokenizers, strict=True):
        ids = set(vocab.values())
        added = {a.content: a for i, a in tokenizer.get_added_tokens_decoder().items()
                 if i in ids}
        plain = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])
                 if t not in have and t not in added]
        out.add_tokens(plain)
        have.update(plain)
        for content, token in added.items():
            added_tokens.setdefault(content, token)
    for content, token in added_tokens.items():  # as they were: special or not
        if content not in have:
            (out.add_special_tokens if token.special else out.add_tokens)([token])
    return out


def _alignment(recipe: MergeRecipe, models: list[SourceModel], vocabs: list[dict[str, int]],
               vocab: dict[str, int], index: dict[str, int]) -> VocabularyAlignment:
    """Each model's row of each output token, and the fill of every token some model lacks."""
    spec = recipe.tokenizer
    assert spec is not None
    tokens = len(vocab)
    rows = {m: torch.full((tokens,), -1, dtype=torch.long) for m in range(len(models))}
    for m, model_vocab in enumerate(vocabs):
        shared = [(vocab[t], i) for t, i in model_vocab.items() if t in vocab]
        if shared:
            at, own_ids = zip(*shared, strict=True)
            rows[m][list(at)] = torch.tensor(own_ids)
    base = 0 if recipe.base_model is not None else None
    have = torch.stack(list(rows.values())) >= 0  # [models, tokens]
    everywhere = have.all(dim=0)
    zero, mean, explicit = [], [], []
    forced = [vocab[t] for t, e in spec.tokens.items() if e.force]
    own: dict[int, list[int]] = {}
    by_id = {i: t for t, i in vocab.items()}
    for i in sorted({*(~everywhere).nonzero().flatten().tolist(), *forced}):
        token = by_id[i]
        present = have[:, i].nonzero().flatten().tolist()
        entry = spec.tokens.get(token)
        source = entry.source if entry is not None else None
        if source == "zero" or (source is None and not present):
            zero.append(i)
        elif isinstance(source, TokenFrom):
            m = index[source.model]
            row = source.token_id if source.token is None else vocabs[m].get(source.token)
            if row is None or row >= models[m].config["vocab_size"]:
                raise RecipeError(f"tokenizer.tokens.{token}: {models[m].where()} has no row "
                                  f"for {source.token if source.token is not None else row!r}")
            explicit.append((i, m, row))
        elif source is not None:
            m = index[source]
            if rows[m][i] < 0:
                raise RecipeError(f"tokenizer.tokens.{token}: {models[m].where()} has no such "
                                  "token to take its row from")
            own.setdefault(m, []).append(i)
        elif len(present) == 1:
            own.setdefault(present[0], []).append(i)
        elif base is not None and base in present:
            own.setdefault(base, []).append(i)
        else:
            mean.append(i)
    pad = spec.pad_to_multiple_of or 1
    size = -(-tokens // pad) * pad
    counts = {"in every model": int(everywhere.sum()),
              "from one model": sum(len(v) for v in own.values()), "averaged": len(mean),
              "zero": len(zero), "from `tokens`": len(explicit), "forced": len(forced)}
    return VocabularyAlignment(tokens, size, rows, _long(zero),
                               {m: _long(v) for m, v in own.items()}, explicit, _long(mean),
                               _long(forced), counts)


def _long(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)
