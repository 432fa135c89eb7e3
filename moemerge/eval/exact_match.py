"""Greedy exact match without generating: a model's greedy decoding of a prompt begins with a
reference answer exactly when, teacher-forced on the answer, its argmax at every answer position
is the answer's next token. One prefill of the prompt (where sequence-routed models choose their
experts, as in generation) and one cached forward over the answer replace up to len(answer)
decoding steps; the result is the same as `generate(do_sample=False)`'s.

Two tasks users recognise, made from held-out text:
- math: the final value of a worked answer ("... = 85."), given the problem, the working before
  it and the problems before it in the same document;
- code: the second half of a source line, ended there (the next token starts with a newline),
  given its first half and up to `context` tokens before it (line completion).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

MATH_CONTEXT_LINES = 3  # earlier problems of the same document shown before each one


def answer_ids(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) as the tokenizer splits prompt + answer, so that a token that
    spans the boundary stays whole; the answer's ids are what greedy decoding must produce."""
    ids = lambda text: tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # noqa: E731
    head, whole = ids(prompt), ids(prompt + answer)
    cut = next((i for i, (a, b) in enumerate(zip(head, whole, strict=False)) if a != b),
               len(head))
    return whole[:cut], whole[cut:]


@torch.no_grad()
def greedy_continues(model, head: Sequence[int], tail: Sequence[int],
                     then: Callable[[int], bool] | None = None) -> bool:
    """Whether greedy decoding from the ids `head` produces the ids `tail` next, and (with
    `then`) a token for which `then` holds after them."""
    from moemerge.modeling.pretrained_moemerge import CACHE

    if not head or not tail:
        raise ValueError("exact match needs a prompt and an answer of at least one token each")
    device = next(model.parameters()).device
    first = model(input_ids=torch.tensor([list(head)], device=device), use_cache=True)
    logits = [first.logits[0, -1:]]  # [1, V]: predicts tail[0]
    fed = list(tail) if then else list(tail[:-1])  # the tokens whose next one is checked
    if fed:  # through the prompt's cache, as decoding runs
        rest = model(input_ids=torch.tensor([fed], device=device), use_cache=True,
                     **{CACHE: first[CACHE]})
        logits.append(rest.logits[0])  # [len(fed), V]
    guess = torch.cat(logits).argmax(-1).tolist()
    return guess[:len(tail)] == list(tail) and (then is None or then(guess[-1]))


def greedy_matches(model, tokenizer, items: Sequence[tuple[str, str]],
                   line: bool = False) -> list[bool]:
    """For each (prompt, answer): whether greedy decoding from `prompt` begins with `answer`'s
    tokens (as the tokenizer splits prompt + answer); with `line`, then ends the line (its next
    token starts with a newline: BPEs merge a newline with the next line's indent, so the
    newline is not part of the answer)."""
    model.eval()
    ends = (lambda t: tokenizer.decode([t]).startswith("\n")) if line else None
    return [greedy_continues(model, *answer_ids(tokenizer, prompt, answer), ends)
            for prompt, answer in items]


def math_items(text: str, count: int) -> list[tuple[str, str]]:
    """(prompt, final value) of the first `count` worked problems in `text` (one per line,
    "Q: ... A: ... = value."; documents separated by blank lines)."""
    items = []
    for doc in text.split("\n\n"):
        lines = [line for line in doc.split("\n") if line.startswith("Q: ") and " = " in line]
        for i, line in enumerate(lines):
            cut = line.rindex(" = ") + len(" = ")
            before = "\n".join(lines[max(0, i - MATH_CONTEXT_LINES): i])
            items.append(((before + "\n" if before else "") + line[:cut], line[cut:]))
            if len(items) == count:
                return items
    return items


def code_items(text: str, tokenizer, count: int, context: int = 96,
               min_chars: int = 12) -> list[tuple[str, str]]:
    """(up to `context` tokens of the file before a line plus the line's first half, the rest
    of the line without its newline) for `count` lines of at least `min_chars` non-blank
    characters, spread evenly over `text` (documents separated by blank lines; a line's context
    stays within its document). Line completion, as CodeXGLUE's line-level task: the whole next
    line is out of a small model's reach (every model of the real set scored ~2 %), its second
    half is not."""
    candidates = []
    for doc in text.split("\n\n"):
        lines = doc.split("\n")
        for i in range(3, len(lines) - 1):  # a line that a newline ends
            if len(lines[i].strip()) >= min_chars:
                candidates.append(("\n".join(lines[:i]) + "\n", lines[i]))
    stride = max(1, len(candidates) // count)
    items = []
    for before, line in candidates[::stride][:count]:
        cut = completion_cut(line)
        ids = tokenizer(before, add_special_tokens=False, verbose=False)["input_ids"]
        items.append((tokenizer.decode(ids[-context:]) + line[:cut], line[cut:]))
    return items


def completion_cut(line: str) -> int:
    """Where a line's completion starts: after the last character that ends a word (not a
    letter, digit or underscore) at or before the middle of its non-blank part, else after its
    indent."""
    start = len(line) - len(line.lstrip())
    ends = [i + 1 for i in range(start, (start + len(line)) // 2 + 1)
            if not (line[i].isalnum() or line[i] == "_")]
    return ends[-1] if ends else start
