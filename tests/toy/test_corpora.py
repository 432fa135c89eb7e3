"""Offline domain text (deterministic, disjoint splits, code without docstrings, correct math)
and the toy tokenizer trained on it."""

import ast
import random
import re
from fractions import Fraction

import pytest
from transformers import AutoTokenizer

from moemerge.toy.corpora import (
    DOMAINS,
    HELD_OUT_DOMAINS,
    SEPARATOR,
    domain_text,
    domain_texts,
    math_problems,
    strip_docstrings,
)
from moemerge.toy.tokenizer import BOS_ID, EOS_ID, PAD_ID, train_tokenizer


@pytest.mark.parametrize("domain", DOMAINS + HELD_OUT_DOMAINS)
def test_domain_text_is_deterministic_and_sized(domain):
    first = domain_text(domain, 20_000, seed=3)
    assert first == domain_text(domain, 20_000, seed=3)
    assert 10_000 < len(first) <= 20_000 and first.strip()
    assert domain_text(domain, 20_000, seed=4) != first


@pytest.mark.parametrize("domain", DOMAINS + HELD_OUT_DOMAINS)
def test_train_and_eval_text_differ(domain):
    train, held_out = domain_texts(domain, 20_000, 5_000)
    assert held_out and held_out[:2000] not in train


def test_unknown_domain_lists_the_known_ones():
    with pytest.raises(ValueError, match="code, prose, math"):
        domain_text("poetry", 100)


def test_code_has_no_docstrings_or_comments():
    source = (
        '"""Module doc."""\nclass A:\n    """Class doc."""\n    def f(self):\n'
        '        """Function doc."""\n        return 1  # a comment\n'
    )
    stripped = strip_docstrings(ast.parse(source))
    assert "doc" not in stripped and "comment" not in stripped and "return 1" in stripped
    code = domain_text("code", 200_000)
    assert code.count("def ") > 200
    # a string literal as the first statement of a module, class or function is a docstring
    assert not re.search(r"(def|class) [^\n]*:\n\s+[rbuRBU]?['\"]", code)
    assert not any(doc.lstrip().startswith(("'", '"')) for doc in code.split(SEPARATOR))


def test_the_held_out_domains_are_what_they_say():
    """Stubs declare without bodies; markdown is READMEs, not METADATA headers; tests are the
    stdlib's unit tests, none of which the code domain holds."""
    stubs = domain_text("stubs", 50_000)
    assert stubs.count("def ") > 100 and stubs.count(": ...") + stubs.count("-> ") > 100
    markdown = domain_text("markdown", 50_000)
    assert markdown.count("\n#") > 10 and "Metadata-Version:" not in markdown
    tests = domain_text("tests", 50_000)
    assert tests.count("self.assert") > 50 and tests[:3000] not in domain_text("code", 10**6)


def test_prose_is_docstrings():
    prose = domain_text("prose", 50_000)
    assert "def " not in prose[:5000] and len(prose.split()) > 5000


def test_math_answers_are_correct():
    docs = math_problems(random.Random(0))
    problems = [line for _ in range(50) for line in next(docs).splitlines()]
    checked = 0
    for line in problems:
        if m := re.fullmatch(r"Q: What is (-?\d+) ([-+*]) (-?\d+)\? A: .* = (-?\d+)\.", line):
            a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
            assert {"+": a + b, "-": a - b, "*": a * b}[op] == c, line
            checked += 1
        elif m := re.fullmatch(r"Q: Solve (\d+)x \+ (\d+) = (-?\d+)\. A: .* x = (-?\d+)\.", line):
            assert int(m[1]) * int(m[4]) + int(m[2]) == int(m[3]), line
            checked += 1
        elif m := re.fullmatch(r"Q: What is (\S+) \+ (\S+)\? A: .* = (\S+)\.", line):
            assert Fraction(m[1]) + Fraction(m[2]) == Fraction(m[3]), line
            checked += 1
        elif m := re.fullmatch(r"Q: What is (\d+)% of (\d+)\? A: .* = (\d+)\.", line):
            assert int(m[1]) * int(m[2]) == 100 * int(m[3]), line
            checked += 1
    assert checked > 200


TEXTS = ["def add(a, b):\n    return a + b\n" * 50, "Return the sum of two numbers. " * 50]


def test_round_trip_and_special_ids(tmp_path):
    tok = train_tokenizer(TEXTS, 300)
    text = "def sub(x):\n\treturn x - 1  # naïve ✓ 🙂"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and max(ids) < 300
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)

    tok.save_pretrained(tmp_path)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in tmp_path.iterdir()}
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text, add_special_tokens=False)["input_ids"] == ids
    assert loaded.eos_token == "</s>" and loaded.bos_token == "<s>"


def test_training_is_deterministic():
    assert train_tokenizer(TEXTS, 300).get_vocab() == train_tokenizer(TEXTS, 300).get_vocab()
